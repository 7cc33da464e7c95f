"""RetroInfer against references written here from its definition (policies/retroinfer.py docstring).

The reference k-means loops over clusters with explicit squared distances; the reference attention builds,
per query head, the full logit row over every slot, masks it to the exact slots (recent set + members of the
top clusters) and appends one pseudo-token per estimated cluster (logit q.c * scale + log count, value the
members' mean). The reference generation recomputes the whole sequence each token with that attention on
every decode row (prompt rows dense), rebuilding the index from that forward's own prompt keys.
"""

import copy
import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ConfigError
from engine.registry import create_method

PAGE = 4
PROMPT_LENS = (20, 45, 70)
MAX_NEW = 6
CFG = {"cluster_size": 4, "iters": 3, "exact_clusters": 3, "estimated_clusters": 4, "window": 4,
       "dense_layers": 0}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=True)


def make_prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]


def engine(model_dir, **method_config):
    return LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE, max_num_batched_tokens=24,
               method="retroinfer", method_config={**CFG, **method_config})


def request_slots(cache, req, n):
    pages = cache.table(req).pages
    return torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(n)])


# --- the references --------------------------------------------------------------------------------------
def reference_kmeans(keys, num_clusters, iters):
    """One head's keys [m, D]: init at slots floor(j m / C), Lloyd rounds, empty clusters stay put."""
    m = keys.shape[0]
    centroids = torch.stack([keys[j * m // num_clusters] for j in range(num_clusters)])
    for _ in range(iters):
        assign = ((keys[:, None, :] - centroids[None]) ** 2).sum(-1).argmin(1)
        centroids = torch.stack([keys[assign == c].mean(0) if (assign == c).any() else centroids[c]
                                 for c in range(num_clusters)])
    return assign, centroids


def reference_index(keys, values, cfg):
    """keys/values [n, Hkv, D] of the prompt -> per KV head (assign, centroids, counts, value sums), m."""
    m = keys.shape[0] - cfg["window"]
    num_clusters = math.ceil(m / cfg["cluster_size"])
    heads = []
    for h in range(keys.shape[1]):
        assign, centroids = reference_kmeans(keys[:m, h].float(), num_clusters, cfg["iters"])
        counts = torch.tensor([(assign == c).sum().item() for c in range(num_clusters)], dtype=torch.float32)
        sums = torch.stack([values[:m, h].float()[assign == c].sum(0) for c in range(num_clusters)])
        heads.append((assign, centroids, counts, sums))
    return heads, m


def reference_attention(q, keys, values, index, cfg, aggregate="max"):
    """One decode query q [Hq, D] over keys/values [n, Hkv, D] under RetroInfer's rule -> [Hq, D]."""
    heads, m = index
    hq, d = q.shape
    n, hkv = keys.shape[:2]
    group, scale = hq // hkv, d**-0.5
    out = torch.empty(hq, d)
    for h in range(hkv):
        assign, centroids, counts, sums = heads[h]
        qg = q[h * group:(h + 1) * group].float()
        per_head = qg @ centroids.T  # [group, C]
        score = per_head.max(0).values if aggregate == "max" else per_head.sum(0)
        ranked = sorted((c for c in range(len(counts)) if counts[c] > 0), key=lambda c: -score[c].item())
        exact = set(ranked[:cfg["exact_clusters"]])
        estimated = ranked[cfg["exact_clusters"]:cfg["exact_clusters"] + cfg["estimated_clusters"]]
        mask = torch.tensor([j >= m or assign[j].item() in exact for j in range(n)])
        for g in range(group):
            full = (keys[:, h].float() @ qg[g]) * scale  # [n] the full logit row
            pseudo = torch.stack([qg[g] @ centroids[c] * scale + math.log(counts[c]) for c in estimated]) \
                if estimated else torch.zeros(0)
            p = torch.softmax(torch.cat([full.masked_fill(~mask, float("-inf")), pseudo]), 0)
            means = torch.stack([sums[c] / counts[c] for c in estimated]) if estimated else torch.zeros(0, d)
            out[h * group + g] = p[:n] @ values[:, h].float() + p[n:] @ means
    return out


class RetroDenseRunner:
    """Full-sequence attention: prompt rows causal and dense, every later row by ``reference_attention``."""

    wants_layer_output = True  # the model calls end_layer (LayerRunner)

    def __init__(self, prompt_len, cfg):
        self.prompt_len, self.cfg = prompt_len, cfg

    def attention(self, layer, q, k, v):
        T, hq, d = q.shape
        group = hq // k.shape[1]
        logits = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(group, 1)) * d**-0.5
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, v.float().repeat_interleave(group, 1))
        if layer >= self.cfg["dense_layers"] and self.prompt_len - self.cfg["window"] >= 1:
            index = reference_index(k[: self.prompt_len], v[: self.prompt_len], self.cfg)
            for row in range(self.prompt_len, T):
                out[row] = reference_attention(q[row], k[: row + 1], v[: row + 1], index, self.cfg,
                                               self.cfg.get("aggregate", "max"))
        return out.to(q.dtype)

    def end_layer(self, layer, hidden):
        pass


@torch.no_grad()
def reference_generate(model, prompt, max_new, cfg):
    ids = list(prompt)
    for _ in range(max_new):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), RetroDenseRunner(len(prompt), cfg))
        ids.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return ids[len(prompt):]


# --- (1) the index --------------------------------------------------------------------------------------
def test_the_index_equals_a_reference_kmeans(tiny_dirs):
    llm = engine(tiny_dirs["qwen3"])
    method, cache = llm.engine.method, llm.engine.cache
    built = []
    original = method.end_step

    def end_step(batch):
        original(batch)
        for req in batch.finished_prompt:
            n = cache.physical_len(req)
            assert n == req.num_prompt_tokens
            slots = request_slots(cache, req, n)
            kv = [(cache.layer_kv(layer)[0].flatten(0, 1)[slots].clone(),
                   cache.layer_kv(layer)[1].flatten(0, 1)[slots].clone()) for layer in range(cache.spec.num_layers)]
            built.append((copy.deepcopy(method._index[req.request_id]), kv))

    method.end_step = end_step
    llm.generate(make_prompts(), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert sorted(len(kv[0][0]) for _, kv in built) == sorted(PROMPT_LENS)
    for index, kv in built:
        assert len(index) == cache.spec.num_layers
        for layer, got in enumerate(index):
            heads, m = reference_index(*kv[layer], CFG)
            assert got.num_clustered == m == len(kv[layer][0]) - CFG["window"]
            for h, (assign, centroids, counts, sums) in enumerate(heads):
                assert torch.equal(got.assign[h], assign)
                torch.testing.assert_close(got.centroids[h], centroids, atol=1e-5, rtol=1e-5)
                assert torch.equal(got.counts[h], counts)
                torch.testing.assert_close(got.value_sum[h], sums, atol=1e-5, rtol=1e-5)
            assert (got.counts > 1).any() and got.counts.shape[1] == math.ceil(m / CFG["cluster_size"])
    assert method._index == {}, "release drops every request's index"


# --- (2) one decode step's attention ---------------------------------------------------------------------
@pytest.mark.parametrize("aggregate", ["max", "sum"])
def test_a_decode_steps_attention_equals_the_dense_definition(tiny_dirs, aggregate):
    cfg = {**CFG, "aggregate": aggregate, "dense_layers": 1}
    llm = engine(tiny_dirs["qwen3"], aggregate=aggregate, dense_layers=1)
    method, cache = llm.engine.method, llm.engine.cache
    captured = []
    after = method.after_attention

    def after_attention(layer, batch, out, scores):
        dense_out = out.clone()
        after(layer, batch, out, scores)
        q, view, row = batch.scratch["retroinfer_q"], batch.view_for(layer), 0
        for req, n, length in zip(batch.requests, view.query_lens_cpu, view.kv_lens_cpu):
            if n == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
                slots = request_slots(cache, req, length)
                k, v = (x.flatten(0, 1)[slots].clone() for x in cache.layer_kv(layer))
                captured.append((layer, req.num_prompt_tokens, q[row].clone(), k, v, out[row].clone(),
                                 dense_out[row]))
            row += n

    method.after_attention = after_attention
    llm.generate(make_prompts(1), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    decode_rows = [c for c in captured if c[0] >= 1]
    assert len(decode_rows) == len(PROMPT_LENS) * 2 * (cache.spec.num_layers - 1)
    moved = 0
    for layer, prompt_len, q, k, v, got, dense_out in captured:
        if layer < 1:
            continue
        index = reference_index(k[:prompt_len], v[:prompt_len], cfg)
        want = reference_attention(q, k, v, index, cfg, aggregate)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        moved += not torch.allclose(got, dense_out, atol=1e-4)
    assert moved > 0, "dropping and estimating clusters must change some outputs"
    for layer, _, _, _, _, got, dense_out in captured:
        if layer < 1:
            assert torch.equal(got, dense_out)  # dense layer untouched


# --- (3) greedy generation -------------------------------------------------------------------------------
def test_latent_caches_are_refused_at_configuration(tiny_dirs):
    with pytest.raises(ConfigError, match=r"values \(32\) are narrower than its keys \(40\), a latent \(MLA\) cache"):
        engine(tiny_dirs["deepseek_v3"])


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_tokens_equal_the_reference_generation(tiny_dirs, arch):
    llm = engine(tiny_dirs[arch])
    prompts = make_prompts(2)
    outs = llm.generate(prompts, GREEDY)
    dense = LLM(tiny_dirs[arch], dtype="float32", device="cpu", page_size=PAGE,
                max_num_batched_tokens=24).generate(prompts, GREEDY)
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == reference_generate(llm.engine.model, prompt, MAX_NEW, CFG)
    assert any(o.logprobs != d.logprobs for o, d in zip(outs, dense)), "the method must change the computation"


# --- (4) every cluster exact reproduces dense ------------------------------------------------------------
@pytest.mark.parametrize("knobs", [{"exact_clusters": 1000}, {"exact_clusters": 1000, "estimated_clusters": 0},
                                   {"window": 200}])
def test_every_cluster_exact_reproduces_dense(tiny_dirs, knobs):
    prompts = make_prompts(3)
    llm = engine(tiny_dirs["qwen3"], **knobs)
    calls = []
    attend = llm.engine.method.attend
    llm.engine.method.attend = lambda *a: calls.append(1) or attend(*a)
    outs = llm.generate(prompts, GREEDY)
    dense = LLM(tiny_dirs["qwen3"], dtype="float32", device="cpu", page_size=PAGE,
                max_num_batched_tokens=24).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in dense]
    for o, d in zip(outs, dense):
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(d.logprobs), atol=1e-4, rtol=1e-4)
    expected_calls = 0 if knobs.get("window") == 200 else len(prompts) * (MAX_NEW - 1) * 2
    assert len(calls) == expected_calls


# --- (5) knobs -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [
    {"cluster_size": 0}, {"cluster_size": "16"}, {"iters": 0}, {"iters": True}, {"exact_clusters": -1},
    {"estimated_clusters": -1}, {"window": -1}, {"dense_layers": -1}, {"aggregate": "mean"}, {"budget": 64},
    {"exact_clusters": 2.5},
])
def test_bad_knobs_raise_config_error(options):
    with pytest.raises(ConfigError):
        create_method("retroinfer", options)


def test_default_knobs():
    import dataclasses

    assert dataclasses.asdict(create_method("retroinfer", None).config) == {
        "cluster_size": 16, "iters": 4, "exact_clusters": 64, "estimated_clusters": 256, "window": 64,
        "dense_layers": 2, "aggregate": "max"}
