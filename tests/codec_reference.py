"""The KV codecs' (FP8, KIVI, TurboQuant) references: definitions written independently of policies/ (KIVI's group
min/max), a codec's round trip through its own fields, the K/V a tiny model produces, and an incremental dense
torch forward of our model code that stores every token's K/V in full precision and applies the codec's
quantization from its definition when attention reads them. Tests: tests/policies/test_fp8_kv.py, test_kivi.py,
test_turboquant.py, test_kv_codecs_shared.py.
"""

import math

import torch

from engine import LLM

PAGE = 8
KIVI = {"bits": 4, "group_size": 8, "residual": 16}


def make_llm(model_dir, storage=None, cfg=None, method="dense", mcfg=None, **kw):
    kw.setdefault("num_pages", 256)
    return LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE, max_num_batched_tokens=32,
               kv_storage=storage, kv_storage_config=cfg or {}, method=method, method_config=mcfg or {}, **kw)


def prompts(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]


# --- the definitions, written independently of policies/ ------------------------------------------------------
def asym_group_roundtrip(x, bits, dim):
    """KIVI's asymmetric quantization with min/max over ``dim``; fp16 zero rounded down, scale rounded up."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    levels = 2**bits - 1
    zero = lo.half()
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.tensor(-math.inf, dtype=torch.half)), zero)
    scale = ((hi - zero.float()) / levels).half()
    scale = torch.where(scale.float() * levels + zero.float() < hi,
                        torch.nextafter(scale, torch.tensor(math.inf, dtype=torch.half)), scale)
    s = scale.float()
    q = ((x - zero.float()) / torch.where(s > 0, s, 1.0)).round().clamp(0, levels)
    return q * s + zero.float(), s


def kivi_keys(k, bits, group):
    """k [n, H, D] (n a multiple of group): per channel over each group of tokens."""
    n, h, d = k.shape
    out, s = asym_group_roundtrip(k.view(n // group, group, h, d), bits, 1)
    return out.view(n, h, d), s.expand(-1, group, -1, -1).reshape(n, h, d)


def kivi_values(v, bits, group):
    n, h, d = v.shape
    out, s = asym_group_roundtrip(v.view(n, h, d // group, group), bits, -1)
    return out.view(n, h, d), s.expand(-1, -1, -1, group).reshape(n, h, d)


def roundtrip(codec, side, x):
    tc = getattr(codec, side)
    fields = tc.encode(x)
    specs = tc.fields(x.shape[-1])
    per_slot = {k: v.repeat_interleave(tc.token_group, 0) if specs[k].per_group else v for k, v in fields.items()}
    return tc.decode(per_slot, x.shape[-1])


def model_kv(model_dir, n=64):
    """K/V a tiny model produces for a random prompt (per layer, [n, Hkv, D])."""
    from engine.loader import load_model

    model, _ = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    got = []

    class Rec:
        wants_layer_output = True  # the model calls end_layer (LayerRunner)

        def attention(self, layer, q, k, v):
            got.append((k.clone(), v.clone()))
            return DenseRunner.attend(q, k, v, torch.ones(k.shape[1], q.shape[0], k.shape[0], dtype=torch.bool).tril())

        def end_layer(self, layer, hidden):
            pass

    with torch.no_grad():
        model(torch.tensor(prompts([n])[0]), torch.arange(n), Rec())
    return got


def kv_samples(tiny_dirs):
    g = torch.Generator().manual_seed(0)
    yield "random", torch.randn(64, 2, 32, generator=g) * 3, torch.randn(64, 2, 32, generator=g)
    for k, v in model_kv(tiny_dirs["qwen3"]):
        yield "model", k, v


# --- attention and tokens -------------------------------------------------------------------------------------
class DenseRunner:
    """Incremental dense attention of our model code: every token's K/V is kept in full precision as it
    was computed; ``readout(layer, k, v, n)`` turns the n stored tokens into what attention reads."""

    wants_layer_output = True  # the model calls end_layer (LayerRunner)

    def __init__(self, readout, kept=None):
        self.readout, self.kept = readout, kept
        self.k, self.v = {}, {}
        self.start = 0

    @staticmethod
    def attend(q, k, v, visible):
        group = q.shape[1] // k.shape[1]
        logits = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(group, 1)) * q.shape[2] ** -0.5
        vis = visible.repeat_interleave(group, 0)
        probs = torch.softmax(logits.masked_fill(~vis, float("-inf")), -1)
        return torch.einsum("hqk,khd->qhd", probs, v.float().repeat_interleave(group, 1)).to(q.dtype)

    def attention(self, layer, q, k, v):
        s = self.start
        self.k[layer] = torch.cat([self.k.get(layer, k[:0]), k])
        self.v[layer] = torch.cat([self.v.get(layer, v[:0]), v])
        n = self.k[layer].shape[0]
        kr, vr = self.readout(layer, self.k[layer], self.v[layer], n)
        heads = k.shape[1]
        visible = torch.zeros(heads, q.shape[0], n, dtype=torch.bool)
        for i in range(q.shape[0]):
            visible[:, i, s:s + i + 1] = True
            for h in range(heads):
                visible[h, i, self.kept[layer][h] if self.kept is not None else list(range(s))] = True
        return self.attend(q, kr, vr, visible)

    def end_layer(self, layer, hidden):
        pass


@torch.no_grad()
def replay(model, prompt, steps, readout, max_new, rule=None, num_layers=2, heads=2):
    """Run the engine's schedule (tokens per step) incrementally; ``rule(kept, e)`` evicts after a step."""
    kept = [[[] for _ in range(heads)] for _ in range(num_layers)] if rule else None
    runner = DenseRunner(readout, kept)
    ids, s = list(prompt), 0
    for n in steps:
        e = s + n
        runner.start = s
        hidden = model(torch.tensor(ids[s:e]), torch.arange(s, e), runner)
        if e == len(ids):
            ids.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
        if rule:
            for layer in kept:
                for h in range(heads):
                    layer[h] = rule(layer[h] + list(range(s, e)))
        s = e
    return ids[len(prompt):len(prompt) + max_new]


def record_steps(llm):
    steps = {}
    inner = llm.engine.method.end_step

    def end_step(batch):
        inner(batch)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            steps.setdefault(req.request_id, []).append(n)

    llm.engine.method.end_step = end_step
    return steps


# a small-budget configuration of every eviction method, for the tests that run each over coded KV
EVICTION_CONFIGS = {
    "streaming_llm": {"sink_tokens": 2, "window": 14, "slack": 2}, "snapkv": {"budget": 24, "window": 8},
    "pyramidkv": {"budget": 24, "window": 8}, "h2o": {"heavy_budget": 8, "recent_budget": 8},
    "tova": {"budget": 16}, "knorm": {"budget": 16}, "rkv": {"budget": 16, "buffer": 8, "alpha": 4},
    "kvzip": {"budget": 16, "window": 4, "chunk_size": 16},
}
