"""Kernel launches of a step's parts, counted on any machine: what each small-op fusion removes.

    python -m benchmarks.launch_count --json launches.json

Runs tiny random checkpoints on the CPU with the GPU's kernel paths taken (``ops.uses_triton`` forced, Triton's
interpreter running the kernels) and counts, per part, every torch operator dispatched outside a Triton kernel
(each is at least one launch on a GPU; views and shape queries excluded) and every Triton launch:

- ``mla-decode``: one decode forward of a GLM-4.7-Flash-like model (latent attention, grouped sigmoid router, a
  shared expert), the MoE layer's launches outside attention (the runner's attention replaced by a stub);
- ``hybrid-linear`` / ``hybrid-attention``: one decode step of a Qwen3.5-like hybrid (gated DeltaNet and gated
  full attention, a dense MLP), the launches of its first linear layer and of its first full-attention layer
  (attention's own kernels excluded; the q/k norms, RoPE and the KV store counted where one kernel fuses them),
  the state reads and writes included;
- ``snapkv-turn``: a SnapKV chain's second turn (its history compacted, then the new prompt's vote and
  compaction), the launches under SnapKV's ``snapkv.vote`` and ``snapkv.compact`` ranges per layer.

A count, not a timing: on a GPU small kernels cost a few microseconds each (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# views and shape queries: no launch on a GPU
_NO_LAUNCH = {"empty", "view", "t", "promote_types", "transpose", "slice", "split_with_sizes", "split",
              "_unsafe_view", "detach", "alias", "expand", "unsqueeze", "select", "as_strided", "permute",
              "squeeze", "reshape", "chunk", "lift_fresh", "sym_size", "size", "stride", "dim", "numel", "unbind",
              "empty_strided", "empty_like", "_local_scalar_dense", "is_nonzero"}


class _Counter(TorchDispatchMode):
    """Counts operators (outside Triton launches) and Triton launches into ``counts[part]`` while ``part`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.part: str | None = None
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._in_kernel = 0
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        counter = self

        def run(fn, *args, **kwargs):
            if counter.part is not None and counter._in_kernel == 0:
                counter.counts[counter.part]["triton:" + fn.fn.__name__] += 1
            counter._in_kernel += 1
            try:
                return original(fn, *args, **kwargs)
            finally:
                counter._in_kernel -= 1

        self._patch = (InterpretedFunction, original)
        InterpretedFunction.run = run

    def close(self) -> None:
        cls, original = self._patch
        cls.run = original

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.part is not None and self._in_kernel == 0 and name not in _NO_LAUNCH:
            self.counts[self.part][name] += 1
        return func(*args, **(kwargs or {}))


def _summary(counts: collections.Counter, per: int) -> dict:
    total = sum(counts.values())
    return {"launches": total, "per_layer": total / per, "by_op": dict(counts.most_common())}


def mla_decode(counter: _Counter, root: Path, tokens: int) -> dict:
    """The launches of one MoE layer's decode forward outside attention (GLM-4.7-Flash's structure)."""
    from agentrt_kernels import ops
    from engine.loader import load_model
    from engine.models.deepseek_v3 import DeepseekMoE
    from engine.tiny_checkpoint import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(root / "glm", "glm4_moe_lite", seed=6, hidden_size=64, num_layers=2,
                                     num_heads=4, head_dim=16, intermediate_size=128, vocab_size=512,
                                     max_position_embeddings=1024, initializer_range=0.1, moe_intermediate_size=32,
                                     kv_lora_rank=32, qk_rope_head_dim=8, num_experts=4, num_experts_per_tok=2,
                                     q_lora_rank=48)
    model, _ = load_model(model_dir, dtype=torch.bfloat16)
    moe_layer = next(i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, DeepseekMoE))

    class StubAttention:  # attention's own store and decode kernels are the backend's, not counted here
        wants_layer_output = False

        def attention(self, layer_idx, q, k, v):
            part, counter.part = counter.part, None
            try:
                return torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
            finally:
                counter.part = part

    layer = model.model.layers[moe_layer]
    original_forward = layer.forward

    def counted(*args, **kwargs):
        counter.part = "mla-decode"
        try:
            return original_forward(*args, **kwargs)
        finally:
            counter.part = None

    layer.forward = counted
    uses_triton = ops.uses_triton
    ops.uses_triton = lambda x: True
    try:
        ids = torch.arange(5, 5 + tokens)
        with torch.no_grad():
            model(ids, torch.arange(100, 100 + tokens), StubAttention())
    finally:
        ops.uses_triton = uses_triton
    return _summary(counter.counts["mla-decode"], 1)


def hybrid_decode(counter: _Counter, root: Path, tokens: int) -> dict:
    """The launches of one linear (gated DeltaNet) layer and one full-attention layer in a hybrid's decode step,
    through the engine (its state slots and paged KV), attention's kernels excluded."""
    from agentrt_kernels import ops
    from engine import SamplingParams
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.tiny_checkpoint import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(root / "hybrid", "qwen3_5", seed=3, hidden_size=64, num_layers=4,
                                     num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                                     vocab_size=512, full_attention_interval=2)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", max_num_batched_tokens=256,
                                    max_model_len=512))
    layers = engine.model.model.layers  # the engine's own model object
    linear = next(layer for layer in layers if layer.is_linear)
    full = next(layer for layer in layers if not layer.is_linear)

    class AttentionUncounted:  # attention's store and decode kernels are the backend's, not counted here
        def __init__(self, runner):
            self._runner = runner

        def __getattr__(self, name):
            return getattr(self._runner, name)

        def attention(self, *args):
            part, counter.part = counter.part, None
            try:
                return self._runner.attention(*args)
            finally:
                counter.part = part

        def attention_rotary(self, *args, **kwargs):  # the norms, RoPE and the store counted, attention not
            runner, attend = self._runner, self._runner._attend_groups

            def uncounted(*a):
                part, counter.part = counter.part, None
                try:
                    return attend(*a)
                finally:
                    counter.part = part

            runner._attend_groups = uncounted
            try:
                return runner.attention_rotary(*args, **kwargs)
            finally:
                del runner._attend_groups

    def counted(layer, name):
        original = layer.forward

        def forward(hidden, residual, positions, rotary, runner):
            if not decoding:
                return original(hidden, residual, positions, rotary, runner)
            counter.part = name
            try:
                return original(hidden, residual, positions, rotary, AttentionUncounted(runner))
            finally:
                counter.part = None

        layer.forward = forward

    decoding = False
    counted(linear, "hybrid-linear")
    counted(full, "hybrid-attention")
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i in range(tokens):
        engine.add_request(list(range(3 + i, 40 + i)), params)
    engine.step()  # the prompts' prefill (and each request's first token)
    uses_triton = ops.uses_triton
    ops.uses_triton = lambda x: counter.part is not None  # the GPU paths inside the counted layers only
    decoding = True
    try:
        engine.step()  # one decode step of every request
    finally:
        ops.uses_triton = uses_triton
    return {name: _summary(counter.counts[name], 1) for name in ("hybrid-linear", "hybrid-attention")}


def snapkv_turn(counter: _Counter, root: Path) -> dict:
    """Launches under SnapKV's vote and compaction ranges in a chain's second turn, per layer."""
    import engine.storage.dense as dense
    import policies.snapkv as snapkv
    from agentrt_kernels import ops
    from benchmarks.throughput import write_shape_dir
    from engine import SamplingParams
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    @contextlib.contextmanager
    def named(name: str):
        counter.part = name
        try:
            yield
        finally:
            counter.part = None

    engine = LLMEngine(EngineConfig(model=write_shape_dir("tiny", root), load_format="dummy", device="cpu",
                                    method="snapkv", method_config={"budget": 64, "window": 8},
                                    max_num_batched_tokens=512, max_model_len=1024))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def run(prompt: list[int]) -> list[int]:
        rid = engine.add_request(prompt, params, chain_id="c")
        while True:
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    return out.token_ids

    first = [rng.randrange(3, vocab) for _ in range(300)]
    reply = run(first)
    patched = (snapkv.record_function, ops.uses_triton, getattr(dense, "fuse_compaction", None))
    snapkv.record_function = named
    ops.uses_triton = lambda x: counter.part is not None  # the GPU paths inside the ranges only
    dense.fuse_compaction = lambda kv: True  # (absent, and unused, in trees before the compaction kernels)
    try:
        run(first + reply + [rng.randrange(3, vocab) for _ in range(60)])
    finally:
        snapkv.record_function, ops.uses_triton, dense.fuse_compaction = patched
    layers = engine.model_config.num_layers
    return {name: _summary(counter.counts[name], layers) for name in ("snapkv.vote", "snapkv.compact")}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4, help="decode rows of the MLA forward and the hybrid step")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    counter = _Counter()
    try:
        with tempfile.TemporaryDirectory() as tmp, counter:
            result = {"mla-decode": mla_decode(counter, Path(tmp), args.tokens),
                      **hybrid_decode(counter, Path(tmp), args.tokens),
                      **snapkv_turn(counter, Path(tmp) / "tiny")}
    finally:
        counter.close()
    print("part             launches  per layer  kernels")
    for name, r in result.items():
        top = ", ".join(f"{op} {n}" for op, n in list(r["by_op"].items())[:6])
        print(f"{name:16s} {r['launches']:8d} {r['per_layer']:10.2f}  {top}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
