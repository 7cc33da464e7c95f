"""Anthropic's ``clear_tool_uses_20250919`` context edit as pruning, run on a conversation's chain before its
turn (agentrt.anthropic_messages): the chain's oldest tool results, and with ``clear_tool_inputs`` the arguments of
the calls they answer, leave its KV. The chain keeps the messages, so the client's next request, which re-sends
them, still resumes it. A call's arguments are found in the token log of the assistant turn that made it
(agentrt.tool_input_spans), read once per turn and kept for later requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentrt.anthropic_input import Conversation
from agentrt.anthropic_types import (ClearToolUsesApplied, ClearToolUsesEdit, ContextManagementResponse, InputTokens,
                                     ToolUses)
from agentrt.implicit_chains import Resolved
from agentrt.tool_input_spans import call_input_spans, covered, merged
from agentrt.tool_syntax.base import arguments_value
from engine.errors import InvalidRequestError
from sdk.schema import PruneRequest

if TYPE_CHECKING:
    from agentrt.chains import ChainService

DEFAULT_TRIGGER_TOKENS = 100_000  # clear_tool_uses_20250919's defaults
DEFAULT_KEEP_TOOL_USES = 3
READS_KEPT = 1024  # assistant turns whose tool-call input spans are kept read (ToolUseClearing._input_spans)


class ToolUseClearing:
    """The edit on a ChainService's chains; the input spans it reads are kept for the ``READS_KEPT`` assistant
    turns read most recently."""

    def __init__(self, chains: ChainService):
        self.chains = chains
        # (chain, region, start, hash of its tokens) of an assistant turn -> its calls' input spans
        # (agentrt.tool_input_spans.call_input_spans), the most recently read last
        self._reads: dict[tuple[str, int, int, int], list[tuple[str, Any, int, int] | None]] = {}

    async def clear(self, tenant: str, resolved: Resolved, edit: ClearToolUsesEdit | None,
                    conv: Conversation) -> ContextManagementResponse:
        """``clear_tool_uses_20250919`` as pruning: once the prompt is over the trigger, the chain's oldest tool
        results (all but the ``keep`` most recent tool uses, the request's new ones counted first; tools in
        ``exclude_tools`` never) leave the KV, if that frees at least ``clear_at_least`` tokens. With
        ``clear_tool_inputs`` (true, or the tools named) the inputs of the cleared uses leave it too: the tokens
        of each ``tool_use``'s arguments in the assistant turn that made the call (``call_input_spans``), pruned
        as intervals with the results in one prune. The chain keeps the messages, so the client's next request,
        which re-sends them, still resumes it. The report counts every tool use whose result is cleared from the
        chain's KV and the tokens cleared (those results and the inputs of theirs cleared too), as a stateless
        server would report the edit on the re-sent history."""
        state = resolved.state
        if edit is not None:
            excluded = set(edit.exclude_tools or [])
            results = [r for r in state.regions if r.kind == "tool_result"]
            new_uses = [m for m in conv.messages[resolved.offset:] if m["role"] == "tool"]
            trigger = edit.trigger or InputTokens(value=DEFAULT_TRIGGER_TOKENS)
            keep = (edit.keep or ToolUses(value=DEFAULT_KEEP_TOOL_USES)).value
            clearable = [r for r in results if r.tool_name not in excluded]
            kept_here = max(0, keep - sum(1 for m in new_uses if m.get("name") not in excluded))
            due = [r for r in clearable[:max(0, len(clearable) - kept_here)] if not r.pruned]
            # the inputs of every use cleared once this edit has run, not cleared yet (a use whose result an
            # earlier request cleared without clear_tool_inputs included)
            cleared = {r.index for r in due} | {r.index for r in results if r.pruned}
            inputs = [r for r in results if r.index in cleared and _clears_input(edit, r.tool_name)]
            spans = self._input_spans(state, conv, resolved.offset, inputs)
            pruned = [(int(a), int(b)) for a, b in state.row.pruned_intervals or []]
            due_inputs = [span for span in spans.values() if not covered(span, pruned)]
            freed = sum(r.end - r.start for r in due) + sum(hi - lo for lo, hi in due_inputs)
            at_least = edit.clear_at_least.value if edit.clear_at_least is not None else 0
            if ((due or due_inputs) and freed >= at_least
                    and await self._triggered(trigger, state, conv, resolved, len(results))):
                if due_inputs:
                    intervals = await self.intervals(state, [(r.start, r.end) for r in due] + due_inputs)
                    request = PruneRequest(intervals=intervals) if intervals else None
                else:
                    request = PruneRequest(regions=[r.index for r in due])
                if request is not None:
                    await self.chains.prune(state.id, request, tenant=tenant)
                    state = await self.chains.state(state.id, tenant)
                    resolved.state = state
        applied: list[ClearToolUsesApplied] = []
        cleared_results = [r for r in state.regions if r.kind == "tool_result" and r.pruned]
        if edit is not None and cleared_results:
            tokens = sum(r.end - r.start for r in cleared_results)
            touched = {r.turn for r in state.regions if r.kind == "assistant" and r.kept_tokens < r.end - r.start}
            if touched:  # some assistant turn lost tokens: the inputs of the cleared uses among them
                pruned = [(int(a), int(b)) for a, b in state.row.pruned_intervals or []]
                spans = self._input_spans(state, conv, resolved.offset, cleared_results, touched)
                tokens += sum(hi - lo for lo, hi in spans.values() if covered((lo, hi), pruned))
            applied.append(ClearToolUsesApplied(cleared_tool_uses=len(cleared_results), cleared_input_tokens=tokens))
        return ContextManagementResponse(applied_edits=applied)

    def _input_spans(self, state: Any, conv: Conversation, offset: int, results: list[Any],
                     turns: set[int] | None = None) -> dict[str, tuple[int, int]]:
        """tool_use id -> the token span, in the chain's log, of the arguments of the call that the tool-result
        regions ``results`` answer (only calls made in ``turns``, when given). The request's messages before
        ``offset`` are the chain's history message for message (the chain was resolved on them), so the k-th
        assistant message is turn k, and its j-th ``tool_use`` the j-th call in that turn's region; a call whose
        name or arguments read there differ from the message's is left out (never cleared)."""
        calls: dict[str, tuple[int, int, int, dict[str, Any]]] = {}  # id -> (turn, place, the turn's calls, call)
        turn = 0
        for m in conv.messages[:offset]:
            if m["role"] != "assistant":
                continue
            made = m.get("tool_calls") or []
            for j, call in enumerate(made):
                calls.setdefault(call["id"], (turn, j, len(made), call))
            turn += 1
        wanted: dict[int, list[str]] = {}
        for r in results:
            found = calls.get(r.tool_call_id)
            if found is not None and (turns is None or found[0] in turns):
                wanted.setdefault(found[0], []).append(r.tool_call_id)
        regions = {r.turn: r for r in state.regions if r.kind == "assistant"}
        renderer, reader = self.chains.renderer.renderer, self.chains.renderer.reader(state.row.tools)
        spans: dict[str, tuple[int, int]] = {}
        for k, ids in wanted.items():
            region = regions.get(k)
            if region is None:
                continue
            tokens = state.token_ids[region.start:region.end]
            key = (state.id, region.index, region.start, hash(tuple(tokens)))  # a rewound turn's differ
            read = self._reads.pop(key, None)
            if read is None:
                read = call_input_spans(renderer.decode, tokens, reader)
            self._reads[key] = read  # the most recently read last
            while len(self._reads) > READS_KEPT:
                self._reads.pop(next(iter(self._reads)))
            for tool_use_id in ids:
                _, j, n, call = calls[tool_use_id]
                if len(read) < n:  # the turn's calls are its last well-formed blocks (its reasoning's come first)
                    continue
                seen = read[len(read) - n + j]
                if seen is None or seen[0] != call["function"]["name"] or \
                        seen[1] != arguments_value(call["function"]["arguments"]):
                    continue
                spans[tool_use_id] = (region.start + seen[2], region.start + seen[3])
        return spans

    async def intervals(self, state: Any, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The spans merged, within the chain's computed KV (the whole log when the engine does not hold it)."""
        try:
            info = await self.chains.worker.call(lambda e: e.chain_info(state.id), chain=state.id)
            limit = info.computed_tokens
        except InvalidRequestError:  # the engine does not hold the chain: the prune is a no-op
            limit = len(state.token_ids)
        return merged([(lo, min(hi, limit)) for lo, hi in spans])

    async def _triggered(self, trigger: InputTokens | ToolUses, state: Any, conv: Conversation, resolved: Resolved,
                         in_chain: int) -> bool:
        new = conv.messages[resolved.offset:]
        if isinstance(trigger, ToolUses):
            return in_chain + sum(1 for m in new if m["role"] == "tool") > trigger.value
        last = state.token_ids[-1] if state.token_ids else None
        appended = await self.chains.renderer.append(state.history, new, state.row.tools, last, conv.prefix,
                                                     log_ids=state.token_ids)
        return len(state.token_ids) + len(appended.token_ids) > trigger.value


def _clears_input(edit: ClearToolUsesEdit, tool_name: str | None) -> bool:
    """Whether ``edit`` clears the input of a cleared use of ``tool_name`` (never one of ``exclude_tools``)."""
    if tool_name in (edit.exclude_tools or []):
        return False
    if isinstance(edit.clear_tool_inputs, list):
        return tool_name in edit.clear_tool_inputs
    return bool(edit.clear_tool_inputs)
