"""The decode CUDA graphs' static buffers stand for any replayable step, per-layer lengths included.

CUDA graphs need a GPU, but what a replay computes is the captured forward over the static buffers. Here the
"replay" runs that same forward eagerly over the buffers ``DecodeGraphs.load`` filled (bucket padding
included; the torch backend also gets the lengths as host lists, which GPU backends never read), so the
greedy tokens must equal a plain eager run: for dense, for eviction methods whose
layers hold different lengths after compaction (PyramidKV's per-layer budgets, KVzip's non-uniform ones), and
for Quest and OmniKV, whose decode-step selection is part of the captured forward (it reads only the static
buffers).
"""

import random

import pytest

import policies.kvzip  # noqa: F401  (registers the methods)
import policies.pyramidkv  # noqa: F401
import policies.omnikv  # noqa: F401
import policies.quest  # noqa: F401
import policies.rkv  # noqa: F401
from engine import LLM, SamplingParams
from engine.contract.view import QuantizedPagesView
from engine.cuda_graphs import DecodeGraphs

METHODS = [("dense", {}), ("pyramidkv", {"budget": 24, "window": 4}), ("kvzip", {"budget": 12, "window": 4}),
           ("quest", {"token_budget": 16, "dense_layers": 0}),  # their selection runs inside the graph
           ("omnikv", {"observation_layers": [0], "token_budget": 16}),
           ("rkv", {"budget": 24, "buffer": 8, "alpha": 2})]  # replays only steps far from a compression
KIVI = ("kivi", {"bits": 4, "group_size": 4, "residual": 4})


def _run(model_dir, method, cfg, fake_graphs: bool, per_request: bool = False, storage=None, decode_steps=1,
         overlap=False):
    """``per_request``: the engine runs dense and the requests ask for ``method``; ``storage``: a KV codec;
    ``decode_steps``: windows of back-to-back decode steps; ``overlap``: each launched before the last is read."""
    engine_method = ("dense", {}) if per_request else (method, cfg)
    llm = LLM(model_dir, dtype="float32", device="cpu", page_size=4, max_num_batched_tokens=64, num_pages=256,
              method=engine_method[0], method_config=engine_method[1], max_num_seqs=8,
              kv_storage=None if storage is None else storage[0],
              kv_storage_config={} if storage is None else storage[1], decode_steps=decode_steps,
              overlap_decode=overlap)
    runner = llm.engine.runner
    replays, layered = [], []
    if fake_graphs:
        graphs = DecodeGraphs(runner, max_batch=8, max_pages=64, scratch_page=runner.cache.scratch_page,
                              page_size=4)

        def replay(batch):
            b = graphs.load(batch)
            replays.append(b)
            layered.append(batch.layer_views is not None)
            static = graphs._static_batch(b)
            for layer, view in enumerate(static.layer_views):  # the torch backend reads host lengths too
                view.kv_lens_cpu = graphs.kv_lens[layer, :b].tolist()
                if isinstance(view, QuantizedPagesView):
                    view.quant_lens_cpu = view.quant_lens.tolist()
                    if view.window_ids is not None:
                        view.window_ids_cpu = view.window_ids.tolist()
            saved, runner._batch = runner._batch, static
            try:
                return graphs._forward(b)[: batch.num_tokens]
            finally:
                runner._batch = saved

        graphs.run = replay
        runner.graphs = graphs
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 57, 33)]  # 3 requests: bucket 4 pads
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                        methods=(method, cfg) if per_request else None)
    return [o.token_ids for o in outs], replays, layered


@pytest.mark.parametrize("method,cfg", METHODS)
def test_static_buffers_reproduce_eager_decode(tiny_dirs, method, cfg):
    ref, _, _ = _run(tiny_dirs["llama"], method, cfg, fake_graphs=False)
    got, replays, layered = _run(tiny_dirs["llama"], method, cfg, fake_graphs=True)
    assert got == ref
    assert replays and 4 in replays  # three requests decode in the padded bucket of four
    if method in ("pyramidkv", "kvzip"):
        assert any(layered), "no replayed step had per-layer lengths"


@pytest.mark.parametrize("method,cfg", [METHODS[1], METHODS[3]])
def test_graphs_of_another_method_serve_a_request_only_without_captured_hooks(tiny_dirs, method, cfg):
    """Graphs captured with the engine's (dense) method: a per-request PyramidKV replays them (its replayable
    steps run no hook), a per-request Quest must not (its selection would be the dense capture's)."""
    ref, _, _ = _run(tiny_dirs["llama"], method, cfg, fake_graphs=False, per_request=True)
    got, replays, _ = _run(tiny_dirs["llama"], method, cfg, fake_graphs=True, per_request=True)
    assert got == ref
    assert bool(replays) == (method == "pyramidkv")


@pytest.mark.parametrize("method,cfg,storage", [
    ("dense", {}, ("fp8", {})), ("snapkv", {"budget": 24, "window": 4}, ("turboquant", {"bits": 3})),
    ("dense", {}, KIVI), ("snapkv", {"budget": 24, "window": 4}, KIVI), ("dense", {}, ("kivi", {"bits": 2, "group_size": 4, "residual": 8}))],
    ids=["fp8", "snapkv-turboquant", "kivi4", "snapkv-kivi4", "kivi2"])
def test_static_buffers_reproduce_eager_decode_over_codes(tiny_dirs, method, cfg, storage):
    """Under a codec the static views are the layers' coded views, and the replayed steps write and read
    codes like eager ones; with KIVI's full-precision window the replay also reads each row's ring and codes
    length from the static buffers and plans its writes (ring row, open group re-encoded) on the device."""
    ref, _, _ = _run(tiny_dirs["llama"], method, cfg, fake_graphs=False, storage=storage)
    got, replays, layered = _run(tiny_dirs["llama"], method, cfg, fake_graphs=True, storage=storage)
    assert got == ref
    assert replays and 4 in replays and all(layered)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])
def test_static_buffers_reproduce_eager_decode_over_fp8_latent_rows(tiny_dirs, arch):
    """A latent cache stored as fp8 rows: the static views are its coded latent views (the codes read in
    place, as an eager step reads them), so the replayed steps give the eager tokens."""
    ref, _, _ = _run(tiny_dirs[arch], "dense", {}, fake_graphs=False, storage=("fp8", {}))
    got, replays, _ = _run(tiny_dirs[arch], "dense", {}, fake_graphs=True, storage=("fp8", {}))
    assert got == ref
    assert replays and 4 in replays


@pytest.mark.parametrize("method,cfg,storage", [("dense", {}, None), ("dense", {}, ("fp8", {})), METHODS[3] + (None,),
                                                ("kvzip", {"budget": 12, "window": 4}, None), ("dense", {}, KIVI)],
                         ids=["dense", "dense-fp8", "quest", "kvzip", "dense-kivi"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_windows_of_decode_steps_replay_the_static_buffers(tiny_dirs, monkeypatch, method, cfg, storage, overlap):
    """Back-to-back decode steps (``decode_steps``) feed each replay the batch built on the device from the
    previous replay's tokens (``overlap``: a window's first step from the last window's, through page tables
    refreshed for its new pages): the same greedy tokens as eager single steps, every window step replayed."""
    from engine.model_runner import ModelRunner

    ref, _, _ = _run(tiny_dirs["qwen3"], method, cfg, fake_graphs=False, storage=storage)
    windows, inner = [], ModelRunner.execute_decode_steps

    def counting(self, batch, k, ahead=0):
        windows.append(k)
        return inner(self, batch, k, ahead)

    monkeypatch.setattr(ModelRunner, "execute_decode_steps", counting)
    got, replays, _ = _run(tiny_dirs["qwen3"], method, cfg, fake_graphs=True, decode_steps=4, storage=storage,
                           overlap=overlap)
    assert windows and max(windows) == 4
    _, single_replays, _ = _run(tiny_dirs["qwen3"], method, cfg, fake_graphs=True, storage=storage)
    assert got == ref
    assert len(replays) == len(single_replays) and 4 in replays  # one replay per decode step either way
    if overlap:  # single steps, each launched (a window of one) before the last is read
        windows.clear()
        got_single, replays_single, _ = _run(tiny_dirs["qwen3"], method, cfg, fake_graphs=True, storage=storage,
                                             overlap=True)
        assert got_single == ref and len(replays_single) == len(single_replays)
        assert windows and set(windows) == {1}


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_hybrid_decode_replays_read_the_state_slots_from_the_static_buffer(tiny_dirs, arch):
    """A hybrid model's replayed decode step reads and writes each row's recurrent state through the slots in
    the graph's static buffer (padding rows: the storage's scratch slot), so the greedy tokens equal eager ones
    and a padded bucket leaves every request's state as an eager step would."""
    ref, _, _ = _run(tiny_dirs[arch], "dense", {}, fake_graphs=False)
    got, replays, _ = _run(tiny_dirs[arch], "dense", {}, fake_graphs=True)
    assert got == ref
    assert replays and 4 in replays
