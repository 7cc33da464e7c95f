"""Multi-turn quality under lag pruning: tool-result rounds of a chain pruned as the server's lag policy does.

A chain holds a conversation of ``num_rounds`` lookup rounds (`quality.tasks.tool_round_messages`). After the
history is computed, the lag policy prunes the tool results of every round ``r <= newest - lag``
(`agentrt.chain_pruning` applies the same rule), keeping ``keep_ratio`` of each result's KV by the ``knorm`` scorer
(none at 0, all at 1) through ``LLMEngine.prune_chain``; then the last user turn asks for the code of one
round. ``distance`` = rounds from the end (1 = the newest round), so the asked round is pruned iff
``distance > lag``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from quality.runner import answer_params, is_correct
from quality.tasks import SYSTEM_PROMPT, Sample, _number, record_key, render, tool_round_messages

SCORER = "knorm"


@dataclass(slots=True)
class ToolChain:
    history_ids: list[int]  # everything before the final question (computed as the chain's first turn)
    sample: Sample  # the whole prompt (history + question) and the answer
    round_spans: list[tuple[int, int]]  # token interval [L, R) of each round's tool result
    asked_round: int

    @property
    def distance(self) -> int:
        return len(self.round_spans) - self.asked_round


def tool_chain(tokenizer, rng: random.Random, num_rounds: int, asked_round: int, note_words: int = 16) -> ToolChain:
    if not 0 <= asked_round < num_rounds:
        raise ValueError(f"asked_round must be in [0, {num_rounds}), got {asked_round!r}")
    keys: list[str] = []
    while len(keys) < num_rounds:
        key = record_key(rng)
        keys += [] if key in keys else [key]
    codes = [_number(rng) for _ in range(num_rounds)]
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for key, code in zip(keys, codes):
        messages += tool_round_messages(rng, key, code, note_words)
    history = render(tokenizer, messages, False)
    messages.append({"role": "user", "content": f"What was the code of record {keys[asked_round]}?"})
    full = render(tokenizer, messages, True)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    history_ids = tokenizer.encode(history, add_special_tokens=False)
    if not full.startswith(history) or ids[: len(history_ids)] != history_ids:
        raise AssertionError("the chat template's rendering is not prefix-stable at a message boundary")
    spans, cursor = [], 0
    for _ in range(num_rounds):
        start = full.index("<tool_response>\n", cursor) + len("<tool_response>\n")
        end = cursor = full.index("\n</tool_response>", start)
        inside = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
        spans.append((inside[0], inside[-1] + 1))
    answer = codes[asked_round]
    sample = Sample("tool_lookup", ids, tokenizer.encode(answer, add_special_tokens=False), answer,
                    spans[asked_round][0] / len(ids), {"round": asked_round, "num_rounds": num_rounds})
    return ToolChain(history_ids, sample, spans, asked_round)


def pruned_rounds(num_rounds: int, lag: int) -> list[int]:
    """The server's lag rule after the newest round ``num_rounds - 1``: rounds ``r <= newest - lag``."""
    return [r for r in range(num_rounds) if r <= num_rounds - 1 - lag]


def _step_all(engine, ids: list[str]) -> dict[str, list[int]]:
    final: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.token_ids)
    return {rid: final[rid] for rid in ids}


def run_lag(engine, chains: list[ToolChain], lag: int | None, keep_ratio: float, tag: str) -> list[bool]:
    """Correctness per chain with the lag policy applied (``lag=None``: no pruning)."""
    from engine import SamplingParams

    names = [f"{tag}-{i}" for i in range(len(chains))]
    first = [engine.add_request(c.history_ids, SamplingParams(temperature=0.0, max_tokens=1), chain_id=n)
             for c, n in zip(chains, names)]
    _step_all(engine, first)
    for c, name in zip(chains, names):
        rounds = [] if lag is None else pruned_rounds(len(c.round_spans), lag)
        if rounds:
            scorer = SCORER if 0.0 < keep_ratio < 1.0 else None
            result = engine.prune_chain(name, [c.round_spans[r] for r in rounds], scorer=scorer, keep_ratio=keep_ratio)
            if keep_ratio < 1.0 and result.tokens_freed == 0:
                raise RuntimeError(f"chain {name} held no KV to prune (reclaimed: give the engine more pages)")
    second = [engine.add_request(c.sample.prompt_ids, answer_params(c.sample), chain_id=n)
              for c, n in zip(chains, names)]
    outputs = _step_all(engine, second)
    for name in names:
        engine.delete_chain(name)
    end_ids = frozenset(engine.model_config.eos_token_ids)
    return [is_correct(c.sample, outputs[rid], end_ids) for c, rid in zip(chains, second)]
