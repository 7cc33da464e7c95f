"""Grammar engines for structured outputs, measured on this CPU: xgrammar and llguidance, per-token mask cost,
compile time per schema and per-request matcher cost, with the engine's tokenizers (JSON + table).

    python -m benchmarks.grammar_mask --vocab embedded,32000 --json /tmp/grammar_mask.json

Each workload is a grammar plus one valid output, tokenized as the model would emit it (the Hugging Face
tokenizer's encoding, then a stop token); the output is replayed ``--repeat`` times through a fresh matcher:
before each token the matcher fills its row of the token bitmask (what the sampler waits for on every
constrained step), then it accepts the token. Per token: ``fill_p50_us`` / ``fill_us`` (mean) / ``fill_p99_us``
over all positions and replays, ``accept_us`` (mean). ``compile_ms``: the grammar's compile with no cache
(median of ``--compile-repeat``; llguidance builds part of its lexer lazily, so some of its compile lands in
the first masks, the p99). ``matcher_us``: the per-request cost once the compiled grammar is cached
(xgrammar: a ``GrammarMatcher`` over the ``CompiledGrammar``; llguidance: a ``deep_copy`` of a cached
matcher). ``batch_fill_us``: one step's masks for ``--batch`` rows at different positions (each library's
threaded batch call, 2 threads). ``apply_us``: the engine's bitmask-to-logits op
(``engine.structured_output.apply_token_bitmask``) on ``--batch`` rows of fp32 logits, here on the CPU.

xgrammar (needed by this benchmark only: ``pip install xgrammar``) runs its JSON-schema compiler
(``any_whitespace=False``) and, for ``tool_call_lazy``, a ``triggered_tags`` structural tag; llguidance runs the
grammars the engine builds (``engine.structured_output.StructuredOutputs.grammar``).

Tokenizers: ``embedded`` is the embedded model's byte-level BPE (512 tokens); a number builds a byte-level BPE of
that many tokens trained on 3000 of this Python's standard library sources (the tiny training corpus of
``engine.tiny_checkpoint.train_tokenizer`` stops at ~1.2K tokens, and no larger tokenizer is available
offline), cached under ``$AGENTRT_CACHE``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
import time
from pathlib import Path

import torch

TOOLS = [
    {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}},
    {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"], "additionalProperties": False}},
]

WORKLOADS: dict[str, tuple[dict, object]] = {
    "json_object": ({"type": "object"},
                    {"id": 17, "tags": ["a", "bb"], "ok": True, "meta": {"score": -2.5, "note": None}}),
    "person": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"], "additionalProperties": False},
               {"name": "Ada Lovelace", "age": 36}),
    "nested": ({"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "status": {"enum": ["open", "closed", "draft"]},
        "priority": {"type": "integer", "minimum": 0, "maximum": 9},
        "labels": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "owner": {"type": "object", "properties": {"login": {"type": "string"}, "admin": {"type": "boolean"}},
                  "required": ["login", "admin"], "additionalProperties": False}},
        "required": ["title", "status", "priority", "labels", "owner"], "additionalProperties": False},
        {"title": "Fix the parser", "status": "open", "priority": 3, "labels": ["bug", "p1"],
         "owner": {"login": "grace", "admin": False}}),
}
# free text, then a call: the lazy (triggered) grammar that tool_choice "auto" with strict tools uses
TOOL_CALL_TEXT = ('Let me look that up for you.\n<tool_call>\n{"name": "get_weather", "arguments": '
                  '{"city": "Paris", "unit": "c"}}\n</tool_call>')


def load_tokenizer(name: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if name == "embedded":
        from engine.tiny_checkpoint import embedded_model_dir
        return AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    vocab = int(name)
    base = Path(os.environ.get("AGENTRT_CACHE") or Path.home() / ".cache" / "agentrt")
    path = base / "tokenizers" / f"stdlib-bpe-{vocab}.json"
    if not path.exists():
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

        files = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:3000]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab - 5, min_frequency=2, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator((Path(f).read_text(errors="replace") for f in files), trainer)
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(tok.to_str())
    from tokenizers import Tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(path)), eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, stop: list[int]):
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=stop)
        self.setup_ms = 1e3 * (time.perf_counter() - t0)
        self.batcher = xgr.BatchGrammarMatcher(max_threads=2)

    def compile(self, workload: str):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if workload == "tool_call_lazy":
            tags = [{"type": "tag", "begin": f'<tool_call>\n{{"name": "{t["name"]}", "arguments": ',
                     "content": {"type": "json_schema", "json_schema": t["parameters"]}, "end": "}\n</tool_call>"}
                    for t in TOOLS]
            return compiler.compile_structural_tag({"type": "structural_tag", "format": {
                "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags}})
        return compiler.compile_json_schema(json.dumps(WORKLOADS[workload][0]), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def batch_fill(self, matchers, bitmask) -> None:
        self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)


class LLGuidance:
    """llguidance as the engine runs it: the grammars of ``engine.structured_output.StructuredOutputs``."""

    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, stop: list[int]):
        import llguidance

        from engine.structured_output import StructuredOutputs

        self.llg = llguidance
        t0 = time.perf_counter()
        self.so = StructuredOutputs(tokenizer, vocab, stop)
        self.setup_ms = 1e3 * (time.perf_counter() - t0)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, workload: str):
        from engine.structured_output import StructuredSpec

        if workload == "tool_call_lazy":
            spec = StructuredSpec.tool_calls([(t["name"], t["parameters"]) for t in TOOLS], required=False)
        else:
            spec = StructuredSpec.json_schema(WORKLOADS[workload][0])
        m = self.llg.LLMatcher(self.so._tok, self.so.grammar(spec), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, bitmask, row: int) -> None:
        v = bitmask[row]
        matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def batch_fill(self, matchers, bitmask) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])


def measure(lib, tokenizer, vocab: int, workload: str, args) -> dict:
    from engine.structured_output import apply_token_bitmask

    text = TOOL_CALL_TEXT if workload == "tool_call_lazy" else json.dumps(WORKLOADS[workload][1])
    tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    compile_ms = _median_ms(lambda: lib.compile(workload), args.compile_repeat)
    compiled = lib.compile(workload)
    matcher_us = 1e3 * _median_ms(lambda: lib.matcher(compiled), 50)
    words = (vocab + 31) // 32
    bitmask = torch.full((args.batch, words), -1, dtype=torch.int32)
    fills, accepts = [], []
    for _ in range(args.repeat):
        m = lib.matcher(compiled)
        for t in tokens:
            t0 = time.perf_counter()
            lib.fill(m, bitmask, 0)
            t1 = time.perf_counter()
            ok = lib.accept(m, t)
            t2 = time.perf_counter()
            if not ok:
                raise AssertionError(f"{lib.name} rejected token {t} of {workload}")
            fills.append(1e6 * (t1 - t0))
            accepts.append(1e6 * (t2 - t1))
    # one step's mask for a batch: every row at a different position of the output
    matchers = [lib.matcher(compiled) for _ in range(args.batch)]
    for i, m in enumerate(matchers):
        for t in tokens[: i * (len(tokens) - 1) // max(1, args.batch - 1)]:
            lib.accept(m, t)
    batch_fill_us = 1e3 * _median_ms(lambda: lib.batch_fill(matchers, bitmask), 50)
    logits = torch.randn(args.batch, vocab)
    rows = torch.arange(args.batch)
    apply_us = 1e3 * _median_ms(lambda: apply_token_bitmask(logits, bitmask, rows), 50)
    q = statistics.quantiles
    return {"library": lib.name, "vocab": vocab, "workload": workload, "tokens": len(tokens),
            "fill_us": statistics.mean(fills), "fill_p50_us": statistics.median(fills),
            "fill_p99_us": q(fills, n=100)[98],
            "accept_us": statistics.mean(accepts), "accept_p99_us": q(accepts, n=100)[98],
            "compile_ms": compile_ms, "matcher_us": matcher_us, "tokenizer_setup_ms": lib.setup_ms,
            "batch": args.batch, "batch_fill_us": batch_fill_us, "apply_us": apply_us}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", default="embedded,32000", help="comma-separated: embedded and/or BPE sizes")
    ap.add_argument("--libraries", default="xgrammar,llguidance")
    ap.add_argument("--workloads", default=",".join([*WORKLOADS, "tool_call_lazy"]))
    ap.add_argument("--repeat", type=int, default=20, help="replays of each output")
    ap.add_argument("--compile-repeat", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the apply op")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    libs = {"xgrammar": XGrammar, "llguidance": LLGuidance}
    rows = []
    for name in args.vocab.split(","):
        tokenizer = load_tokenizer(name)
        vocab = len(tokenizer)
        stop = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
        for lib_name in args.libraries.split(","):
            lib = libs[lib_name](tokenizer, vocab, stop)
            for workload in args.workloads.split(","):
                rows.append(measure(lib, tokenizer, vocab, workload, args))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    head = ("library", "vocab", "workload", "tokens", "fill_p50_us", "fill_us", "fill_p99_us", "accept_us",
            "compile_ms", "matcher_us", "batch_fill_us", "apply_us")
    print("\n" + " ".join(f"{h:>14}" for h in head))
    for r in rows:
        print(" ".join(f"{r[h]:>14.1f}" if isinstance(r[h], float) else f"{r[h]:>14}" for h in head))
    return rows


if __name__ == "__main__":
    main()
