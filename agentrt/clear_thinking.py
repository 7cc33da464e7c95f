"""Anthropic's ``clear_thinking_20251015`` context edit as pruning: the think blocks of all but the last ``keep``
assistant turns that have one leave the chain's KV. The token log keeps them (the client re-sends the
conversation, which still resumes the chain); only attention stops seeing them, which is what clearing a thinking
block from the prompt means, without recomputing what follows it.

A chain turn is one assistant message (the k-th assistant message of the conversation is turn k); its think
blocks are the closed ``<think> ... </think>`` spans inside its assistant region (the generation prompt included:
a template may open the block there), found in the token log (``agentrt.reasoning.think_blocks``). The report
counts, as a stateless server would on the re-sent history, every turn whose thinking is out of the KV and the
tokens of those blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentrt.anthropic_types import ClearThinkingApplied, ClearThinkingEdit, ThinkingTurns
from agentrt.reasoning import think_blocks
from agentrt.tool_input_spans import covered
from sdk.schema import PruneRequest

if TYPE_CHECKING:
    from agentrt.chain_state import ChainState
    from agentrt.chains import ChainService

DEFAULT_KEEP = 1  # Anthropic's default: the last assistant turn's thinking stays


def kept_turns(edit: ClearThinkingEdit) -> int | None:
    """How many of the latest thinking turns keep their blocks (None: all)."""
    if edit.keep == "all":
        return None
    return edit.keep.value if isinstance(edit.keep, ThinkingTurns) else DEFAULT_KEEP


def blocks_by_turn(state: ChainState, chains: ChainService) -> dict[int, list[tuple[int, int]]]:
    """The closed think blocks of each assistant turn of the chain, as token spans of its log."""
    renderer = chains.renderer.renderer
    if renderer.think is None:
        return {}
    assistant = [r for r in state.regions if r.kind == "assistant"]
    found: dict[int, list[tuple[int, int]]] = {}
    for lo, hi in think_blocks(state.token_ids, renderer.think, renderer.decode):
        region = next((r for r in assistant if r.start <= lo < r.end), None)
        if region is not None:
            found.setdefault(region.turn, []).append((lo, hi))
    return found


async def clear_thinking(chains: ChainService, state: ChainState, edit: ClearThinkingEdit, tenant: str,
                         limit: Any) -> tuple[ChainState, ClearThinkingApplied]:
    """Prune the blocks the edit clears that are still in the KV (``limit(state, spans)``: the spans merged within
    the chain's computed KV); returns the chain as it is then and the edit's report."""
    blocks = blocks_by_turn(state, chains)
    keep = kept_turns(edit)
    turns = sorted(blocks)
    cleared = [] if keep is None else turns[:max(0, len(turns) - keep)]
    spans = [span for turn in cleared for span in blocks[turn]]
    pruned = [(int(lo), int(hi)) for lo, hi in state.row.pruned_intervals or []]
    due = [span for span in spans if not covered(span, pruned)]
    if due:
        intervals = await limit(state, due)
        if intervals:
            await chains.prune(state.id, PruneRequest(intervals=intervals), tenant=tenant)
            state = await chains.state(state.id, tenant)
    return state, ClearThinkingApplied(cleared_thinking_turns=len(cleared),
                                       cleared_input_tokens=sum(hi - lo for lo, hi in spans))
