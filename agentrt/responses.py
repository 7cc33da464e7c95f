"""OpenAI's Responses API over chains (docs/responses.md).

A response is one chain turn. Without ``previous_response_id`` a new chain is created (``instructions`` its system
prompt, ``tools`` its tools); with the id of the chain's latest response the new input items are one more turn of
that chain (only they are prefilled: the chain's KV is resumed); with the id of an older response the chain is
forked and the fork rewound to that response's turn, then the turn is appended there.

The map response -> (chain, turn) lives in this process (``ResponseService.records``); each chain made here carries
``{"agentrt_responses": true}`` in its metadata. After a restart the responses are gone (404) while their chains,
KV and turns stay readable over the chain API. ``store: false``: the response is not retrievable (GET / DELETE /
input_items answer 404) but it can still be continued with ``previous_response_id``, and its chain keeps its KV.

The output is one ``message`` item holding the reply's text without its tool-call markup (when there is any
text), then one ``function_call`` item per call, with the chain's call ids. A stream sends the text as it is
released (agentrt.tool_call_stream) and the calls once the turn has ended, so its items equal the
non-streamed ones. A model that thinks (agentrt.reasoning) has its think block as a ``reasoning`` item first
(``content: [{"type": "reasoning_text", "text"}]``, streamed as ``response.reasoning_text.delta`` events);
``reasoning.effort`` ("none": off, another level: on) is the chat template's ``enable_thinking``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar.datastructures import State
from litestar.exceptions import NotFoundException
from litestar.response import ServerSentEventMessage

from agentrt.chat import calls_in, template_kwargs, without_calls
from agentrt.completions import REASONING_EFFORTS
from agentrt.errors import ModelNotFound, bad_field, openai_error_body
from agentrt.reasoning import ReasoningParser, split_reasoning
from agentrt.reasoning import parser as reasoning_parser
from agentrt.responses_types import (FunctionCallItem, FunctionCallOutputItem, FunctionTool, IncompleteDetails,
                                     InputItem, InputItemList, InputTokensDetails, MessageItem,
                                     OutputFunctionCall, OutputMessage, OutputReasoning, OutputText, OutputTextPart,
                                     OutputTokensDetails, ReasoningItem, ReasoningTextPart, ResponseObject,
                                     ResponsesRequest, ResponseUsage, ToolChoiceFunction)
from agentrt.tool_call_stream import ToolCallStream
from engine.structured_output import schema_error
from sdk.schema import ChainCreate, ForkRequest, RewindRequest, TurnCreate, TurnDelta, TurnResult

log = logging.getLogger(__name__)
METADATA = {"agentrt_responses": True}


class ResponseNotFound(NotFoundException):
    def __init__(self, response_id: str):
        super().__init__(detail=f"no response with the id {response_id!r}")


@dataclass(slots=True)
class Record:
    tenant: str
    chain_id: str
    turn: int  # the chain turn's index (the chain has turn + 1 turns right after it)
    stored: bool
    input_items: list[dict[str, Any]]
    response: ResponseObject | None = None


@dataclass(slots=True)
class Pending:
    response: ResponseObject
    record: Record
    turn: Any  # agentrt.turns.PendingTurn
    parse_calls: bool
    thinking: bool | None = None  # None: the model does not think; else the prompt left a think block open
    seq: int = 0
    items: list[Any] = field(default_factory=list)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _convert(value: Any, kind: Any, key: str) -> Any:
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise bad_field(key, str(exc)) from None


class ResponseService:
    def __init__(self, chains: Any, model_name: str, config: Any):
        self.chains = chains
        self.model_name = model_name
        self.config = config
        self.records: dict[str, Record] = {}

    # --- the request --------------------------------------------------------------------------------------
    def _items(self, req: ResponsesRequest) -> list[InputItem]:
        if isinstance(req.input, str):
            return [MessageItem(role="user", content=req.input)]
        if not req.input:
            raise bad_field("input", "must hold at least one item")
        return [_convert({"type": "message", **raw} if "type" not in raw else raw, InputItem, f"input[{i}]")
                for i, raw in enumerate(req.input)]

    def _refuse(self, req: ResponsesRequest) -> None:
        if req.model != self.model_name:
            raise ModelNotFound(req.model, self.model_name)
        if req.background:
            raise bad_field("background", "this server runs responses in the foreground only")
        for name in ("conversation", "prompt", "top_logprobs"):
            if getattr(req, name) is not None:
                raise bad_field(name, "not supported by this server: leave it out")
        if req.truncation not in (None, "disabled"):
            raise bad_field("truncation", "only 'disabled': a chain is never truncated")
        if req.max_output_tokens is not None and req.max_output_tokens > self.config.max_tokens_per_turn:
            raise bad_field("max_output_tokens", f"must be <= {self.config.max_tokens_per_turn}")
        forced = req.forced_token_ids or []
        vocab = self.chains.worker.engine.model_config.vocab_size
        if len(forced) > (req.max_output_tokens or self.config.max_tokens_per_turn):
            raise bad_field("forced_token_ids", f"has {len(forced)} tokens, more than max_output_tokens")
        if any(t >= vocab for t in forced):
            raise bad_field("forced_token_ids", f"every id must be < the vocabulary size {vocab}")
        if self.chains.renderer.renderer.think is not None and _effort(req) not in (None, *REASONING_EFFORTS):
            raise bad_field("reasoning.effort", f"must be one of {', '.join(REASONING_EFFORTS)} (\"none\": no "
                                                "thinking; any other level turns thinking on)")

    def _tools(self, req: ResponsesRequest) -> list[dict[str, Any]] | None:
        """The chain routes' form of the request's tools (None when left out)."""
        if req.tools is None:
            return None
        tools = []
        for i, raw in enumerate(req.tools):
            if raw.get("type") != "function":
                raise bad_field(f"tools[{i}].type", f"only function tools, not {raw.get('type')!r}")
            t = _convert(raw, FunctionTool, f"tools[{i}]")
            function = {"name": t.name, **({"description": t.description} if t.description else {}),
                        **({"parameters": t.parameters} if t.parameters is not None else {})}
            tools.append({"type": "function", "function": function})
        return tools

    def _sampling(self, req: ResponsesRequest, tools: list[dict[str, Any]]) -> tuple[dict[str, Any], bool]:
        greedy = req.top_p == 0
        sampling: dict[str, Any] = {
            "temperature": 0.0 if greedy else 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None or greedy else req.top_p,
            "max_tokens": req.max_output_tokens or self.config.max_tokens_per_turn}
        if req.forced_token_ids:
            sampling["forced_token_ids"] = list(req.forced_token_ids)
        choice = req.tool_choice
        if choice in ("required",) or isinstance(choice, ToolChoiceFunction):
            if not tools:
                raise bad_field("tool_choice", "forces a tool call, which needs `tools`")
            named = [t for t in tools if not isinstance(choice, ToolChoiceFunction)
                     or t["function"]["name"] == choice.name]
            if not named:
                raise bad_field("tool_choice.name", f"names the tool {choice.name!r}, which is not among the tools")
            for i, t in enumerate(tools):
                if t in named and (why := schema_error(t["function"].get("parameters") or {"type": "object"})):
                    raise bad_field(f"tools[{i}].parameters", f"cannot be followed when tool_choice forces a call: "
                                                              f"{why}")
            sampling["tool_choice"] = "required" if choice == "required" else \
                {"type": "function", "function": {"name": choice.name}}
            if req.parallel_tool_calls is not None:
                sampling["parallel_tool_calls"] = req.parallel_tool_calls
        fmt = req.text.format if req.text is not None else None
        if fmt is not None and fmt.__struct_config__.tag == "json_schema":
            if (why := schema_error(fmt.schema)) is not None:
                raise bad_field("text.format.schema", f"cannot be followed: {why}")
            sampling["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema, "description": fmt.description, "strict": fmt.strict}}
        elif fmt is not None and fmt.__struct_config__.tag == "json_object":
            sampling["response_format"] = {"type": "json_object"}
        return sampling, choice != "none"

    async def _chain(self, req: ResponsesRequest, tenant: str, items: list[InputItem], tools: list | None
                     ) -> tuple[str, list[dict[str, Any]], Any]:
        """The chain the turn goes to, the turn's messages, and the chain's state."""
        system_parts = [req.instructions] if req.instructions is not None else []
        start = 0
        if req.previous_response_id is None:
            while start < len(items) and isinstance(items[start], MessageItem) and \
                    items[start].role in ("system", "developer"):
                system_parts.append(_text(items[start].content))
                start += 1
            messages = self._messages(items, start, None)  # checked before the chain exists
            data = _convert({"system_prompt": "\n".join(system_parts) if system_parts else None,
                             "tools": tools or [], "metadata": METADATA}, ChainCreate, "tools")
            chain = await self.chains.create(data, tenant=tenant)
            state = await self.chains.state(chain.id, tenant)
            previous = None
        else:
            previous = self.records.get(req.previous_response_id)
            if previous is None or previous.tenant != tenant:
                raise bad_field("previous_response_id", f"no response with the id {req.previous_response_id!r}",
                                code="previous_response_not_found")
            state = await self.chains.state(previous.chain_id, tenant)
            if req.instructions is not None and req.instructions != state.row.system_prompt:
                raise bad_field("instructions", "differs from the conversation's (the chain's system prompt is "
                                                "fixed): leave it out or repeat it")
            if tools is not None and tools != state.row.tools:
                raise bad_field("tools", "differ from the conversation's (the chain renders its tools once): "
                                         "leave them out or repeat them")
            messages = self._messages(items, start, previous)
            chain_id = previous.chain_id
            if state.num_turns != previous.turn + 1:  # an older response: branch there
                fork = await self.chains.fork(chain_id, ForkRequest(metadata=METADATA), tenant=tenant)
                await self.chains.rewind(fork.id, RewindRequest(num_turns=previous.turn + 1), tenant=tenant)
                chain_id = fork.id
                state = await self.chains.state(chain_id, tenant)
        return state.id, messages, state

    def _messages(self, items: list[InputItem], start: int, previous: Record | None) -> list[dict[str, Any]]:
        echoed = set()
        if previous is not None and previous.response is not None:
            echoed = {o.call_id for o in previous.response.output if isinstance(o, OutputFunctionCall)}
            echoed |= {o.id for o in previous.response.output if isinstance(o, OutputMessage)}
        messages: list[dict[str, Any]] = []
        for i, item in enumerate(items[start:], start):
            key = f"input[{i}]"
            if isinstance(item, ReasoningItem):
                continue  # an echoed think block: the chain holds the reasoning as generated
            if isinstance(item, FunctionCallItem):
                if item.call_id not in echoed:
                    raise bad_field(f"{key}.call_id", "a function_call item must echo a call of the previous "
                                                      "response's output (the chain holds the conversation)")
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "content": _text(item.output), "tool_call_id": item.call_id})
            elif item.role == "assistant":
                if item.id is None or item.id not in echoed:
                    raise bad_field(f"{key}.role", "an assistant message must echo the previous response's "
                                                   "output (the chain holds the conversation)")
            elif item.role in ("system", "developer"):
                raise bad_field(f"{key}.role", "system and developer messages may only open a new conversation "
                                               "(they become the chain's system prompt with `instructions`)")
            else:
                if not isinstance(item.content, str) and any(isinstance(p, OutputText) for p in item.content):
                    raise bad_field(f"{key}.content", "a user message takes input_text parts")
                messages.append({"role": "user", "content": _text(item.content)})
        if not messages:
            raise bad_field("input", "must hold a user message or a function_call_output")
        return messages

    async def start(self, req: ResponsesRequest, tenant: str) -> Pending:
        self._refuse(req)
        items = self._items(req)
        tools = self._tools(req)
        if req.previous_response_id is not None and tools is None:
            previous = self.records.get(req.previous_response_id)
            if previous is not None and previous.tenant == tenant:
                tools = (await self.chains.state(previous.chain_id, tenant)).row.tools
        sampling, parse_calls = self._sampling(req, tools or [])
        chain_id, messages, state = await self._chain(req, tenant, items, tools)
        made = state.num_turns == 0 or previous_chain(self.records, req.previous_response_id) != chain_id
        try:
            data = _convert({"messages": messages, "sampling": sampling, "stream": bool(req.stream)}, TurnCreate,
                            "input")
            with template_kwargs(enable_thinking=None if _effort(req) is None else _effort(req) != "none"):
                turn = await self.chains.start_turn(chain_id, data, tenant=tenant)
        except BaseException:
            if made:  # a chain created or forked for this request: not left behind
                try:
                    await self.chains.delete(chain_id, tenant=tenant)
                except Exception:
                    log.exception("could not delete chain %s", chain_id)
            raise
        stored = req.store is not False
        input_items = [{**msgspec.to_builtins(it), "id": getattr(it, "id", None) or _new_id("item")}
                       for it in items]
        record = Record(tenant=tenant, chain_id=chain_id, turn=turn.state.num_turns, stored=stored,
                        input_items=input_items)
        response = ResponseObject(
            id=_new_id("resp"), created_at=int(time.time()), model=self.model_name, status="in_progress", output=[],
            instructions=state.row.system_prompt, tools=[_response_tool(t) for t in state.row.tools],
            tool_choice=msgspec.to_builtins(req.tool_choice) if req.tool_choice is not None else "auto",
            parallel_tool_calls=req.parallel_tool_calls is not False, temperature=sampling["temperature"],
            top_p=sampling["top_p"], max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id, metadata=req.metadata or {},
            text=msgspec.to_builtins(req.text) if req.text is not None and req.text.format is not None
            else {"format": {"type": "text"}}, store=stored)
        return Pending(response=response, record=record, turn=turn, parse_calls=parse_calls,
                       thinking=self.chains.renderer.renderer.thinking(turn.prompt))

    # --- the response -------------------------------------------------------------------------------------
    def _finish(self, pending: Pending, result: TurnResult, output: list[Any]) -> ResponseObject:
        u = result.usage
        cached = max(0, u.prompt_tokens - u.prefilled_tokens)
        response = msgspec.structs.replace(
            pending.response, output=output,
            status="incomplete" if result.finish_reason == "length" else "completed",
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if result.finish_reason == "length"
            else None,
            usage=ResponseUsage(input_tokens=u.prompt_tokens, input_tokens_details=InputTokensDetails(
                cached_tokens=cached), output_tokens=u.completion_tokens,
                output_tokens_details=OutputTokensDetails(reasoning_tokens=self._reasoning_tokens(pending, result)),
                total_tokens=u.prompt_tokens + u.completion_tokens))
        pending.record.turn = result.turn
        pending.record.response = response
        self.records[response.id] = pending.record
        return response

    def _reasoning_tokens(self, pending: Pending, result: TurnResult) -> int:
        """The generated tokens of the think block: up to its closing tag, or all of them when it never closed."""
        think = self.chains.renderer.renderer.think
        if pending.thinking is None or think is None:
            return 0
        parser = ReasoningParser(pending.thinking)
        parser.feed(result.message.content)
        parser.finish()
        state = self.chains.states.get(result.chain_id)
        n = result.usage.completion_tokens
        if not parser.found or state is None or not n:
            return 0
        generated = state.token_ids[-n:]
        return generated.index(think.close_id) + 1 if think.close_id in generated else n

    def _output(self, result: TurnResult, pending: Pending, message_id: str | None = None,
                reasoning_id: str | None = None) -> list[Any]:
        thought, text = "", result.message.content
        if pending.thinking is not None:
            thought, text = split_reasoning(text, pending.thinking)
        calls = []
        if pending.parse_calls:
            chain_calls = result.message.tool_calls  # the chain's ids: its tool results are matched to them
            calls = chain_calls[len(chain_calls) - min(len(calls_in(text)), len(chain_calls)):]
            text = without_calls(text)
        output: list[Any] = []
        if thought:
            output.append(OutputReasoning(id=reasoning_id or _new_id("rs"),
                                          content=[ReasoningTextPart(text=thought)]))
        if text:
            output.append(OutputMessage(id=message_id or _new_id("msg"), content=[OutputTextPart(text=text)]))
        output += [OutputFunctionCall(id=_new_id("fc"), call_id=c.id, name=c.function.name,
                                      arguments=c.function.arguments) for c in calls]
        return output

    async def create(self, req: ResponsesRequest, tenant: str) -> ResponseObject:
        pending = await self.start(req, tenant)
        try:
            result = await pending.turn.result()
        finally:
            await pending.turn.close()
        return self._finish(pending, result, self._output(result, pending))

    def _event(self, pending: Pending, kind: str, **body: Any) -> ServerSentEventMessage:
        data = {"type": kind, "sequence_number": pending.seq, **msgspec.to_builtins(body)}
        pending.seq += 1
        return ServerSentEventMessage(event=kind, data=json.dumps(data, ensure_ascii=False))

    async def events(self, pending: Pending) -> AsyncGenerator[ServerSentEventMessage, None]:
        ev = self._event
        yield ev(pending, "response.created", response=pending.response)
        yield ev(pending, "response.in_progress", response=pending.response)
        parser = ToolCallStream() if pending.parse_calls else None
        thinking = reasoning_parser(pending.thinking)
        rs_id, msg_id = _new_id("rs"), _new_id("msg")
        thought, text = "", ""
        thought_done = False  # the reasoning item's done events were sent

        def close_reasoning() -> list[ServerSentEventMessage]:
            nonlocal thought_done
            if not thought or thought_done:
                return []
            thought_done = True
            part = ReasoningTextPart(text=thought)
            return [ev(pending, "response.reasoning_text.done", item_id=rs_id, output_index=0, content_index=0,
                       text=thought),
                    ev(pending, "response.content_part.done", item_id=rs_id, output_index=0, content_index=0,
                       part=part),
                    ev(pending, "response.output_item.done", output_index=0,
                       item=OutputReasoning(id=rs_id, content=[part]))]

        def deltas(piece: str, final: bool = False) -> list[ServerSentEventMessage]:
            nonlocal thought, text
            reasoning, rest = "", piece
            if thinking is not None:
                reasoning, rest = thinking.finish() if final else thinking.feed(piece)
            out = self._reasoning_delta(pending, rs_id, thought, reasoning)
            thought += reasoning
            if parser is not None:
                rest = parser.feed(rest)[0] if rest else ""
                if final:
                    rest += parser.finish()[0]
            if rest:
                out += close_reasoning()
                out += self._text_delta(pending, msg_id, 1 if thought else 0, text, rest)
                text += rest
            return out

        try:
            result: TurnResult | None = None
            async with aclosing(pending.turn.events()) as stream:
                async for event in stream:
                    if not isinstance(event, TurnDelta):
                        result = event
                        continue
                    for e in deltas(event.text):
                        yield e
            assert result is not None
            for e in deltas("", final=True) + close_reasoning():
                yield e
            output = self._output(result, pending, msg_id, rs_id)
            index = 1 if thought else 0
            if text:
                part = OutputTextPart(text=text)
                yield ev(pending, "response.output_text.done", item_id=msg_id, output_index=index, content_index=0,
                         text=text, logprobs=[])
                yield ev(pending, "response.content_part.done", item_id=msg_id, output_index=index,
                         content_index=0, part=part)
                yield ev(pending, "response.output_item.done", output_index=index, item=output[index])
                index += 1
            for item in output[index:]:
                added = msgspec.structs.replace(item, arguments="", status="in_progress")
                yield ev(pending, "response.output_item.added", output_index=index, item=added)
                yield ev(pending, "response.function_call_arguments.delta", item_id=item.id, output_index=index,
                         delta=item.arguments)
                yield ev(pending, "response.function_call_arguments.done", item_id=item.id, output_index=index,
                         name=item.name, arguments=item.arguments)
                yield ev(pending, "response.output_item.done", output_index=index, item=item)
                index += 1
            response = self._finish(pending, result, output)
            kind = "response.completed" if response.status == "completed" else "response.incomplete"
            yield ev(pending, kind, response=response)
        except Exception as exc:  # the status line is sent: the error goes into the stream
            log.info("response stream %s failed: %r", pending.response.id, exc)
            error = msgspec.to_builtins(openai_error_body(exc)).get("error", {})
            yield ev(pending, "error", code=error.get("code"), message=error.get("message", str(exc)),
                     param=error.get("param"))

    def _reasoning_delta(self, pending: Pending, rs_id: str, before: str,
                         delta: str) -> list[ServerSentEventMessage]:
        if not delta:
            return []
        events = []
        if not before:
            item = OutputReasoning(id=rs_id, content=[], status="in_progress")
            events.append(self._event(pending, "response.output_item.added", output_index=0, item=item))
            events.append(self._event(pending, "response.content_part.added", item_id=rs_id, output_index=0,
                                      content_index=0, part=ReasoningTextPart(text="")))
        events.append(self._event(pending, "response.reasoning_text.delta", item_id=rs_id, output_index=0,
                                  content_index=0, delta=delta))
        return events

    def _text_delta(self, pending: Pending, msg_id: str, index: int, before: str,
                    delta: str) -> list[ServerSentEventMessage]:
        if not delta:
            return []
        events = []
        if not before:
            item = OutputMessage(id=msg_id, content=[], status="in_progress")
            events.append(self._event(pending, "response.output_item.added", output_index=index, item=item))
            events.append(self._event(pending, "response.content_part.added", item_id=msg_id, output_index=index,
                                      content_index=0, part=OutputTextPart(text="")))
        events.append(self._event(pending, "response.output_text.delta", item_id=msg_id, output_index=index,
                                  content_index=0, delta=delta, logprobs=[]))
        return events

    # --- stored responses ------------------------------------------------------------------------------------
    def _stored(self, response_id: str, tenant: str) -> Record:
        record = self.records.get(response_id)
        if record is None or record.tenant != tenant or not record.stored or record.response is None:
            raise ResponseNotFound(response_id)
        return record

    def get(self, response_id: str, tenant: str) -> ResponseObject:
        return self._stored(response_id, tenant).response  # type: ignore[return-value]

    def delete(self, response_id: str, tenant: str) -> None:
        """The response is forgotten (its chain and turn stay: they belong to the chain API)."""
        self._stored(response_id, tenant)
        del self.records[response_id]

    def input_items(self, response_id: str, tenant: str, order: str = "desc", limit: int = 20,
                    after: str | None = None) -> InputItemList:
        items = list(self._stored(response_id, tenant).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [i["id"] for i in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                             last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)


def _effort(req: ResponsesRequest) -> str | None:
    effort = (req.reasoning or {}).get("effort")
    return effort if effort is None or isinstance(effort, str) else str(effort)


def previous_chain(records: dict[str, Record], response_id: str | None) -> str | None:
    record = records.get(response_id) if response_id is not None else None
    return record.chain_id if record is not None else None


def _response_tool(tool: dict[str, Any]) -> dict[str, Any]:
    f = tool["function"]
    return {"type": "function", "name": f["name"], "description": f.get("description"),
            "parameters": f.get("parameters"), "strict": False}


def responses_service(state: State) -> ResponseService:
    service = getattr(state, "responses", None)
    if service is None:
        service = ResponseService(state.chains, state.model_name, state.config)
        state.responses = service
    return service
