"""Every request field of OpenAI's chat completions, Responses and Conversations references and of Anthropic's
Messages reference (beta fields and headers included), as the installed ``openai`` and ``anthropic`` packages declare
them, is taken by this server: each is sent once, through the package's own client, against the random test model,
and is accepted, or it is one this server refuses on purpose (a 400 naming it; docs/server.md, docs/responses.md and
docs/anthropic.md say why). So are the variants of the unions a request is made of (message roles, content parts
and blocks, input items, tools, tool choices, formats, thinking, context-management edits), and the examples of the
shapes this server honors carry every key the reference gives them.

The fields are read from the packages, the examples are written here: a field, variant or key that a newer package
declares and that has no example here fails its test, rather than being skipped. Input item, content block and tool
types other than those honored are sent bare and must be refused, naming their type, as any type this server does not
take is."""

from __future__ import annotations

import typing
from typing import Any, Literal

import anthropic
import openai
import pytest
from anthropic.types import beta as anthropic_beta
from anthropic.types import message_count_tokens_params, message_create_params
from anthropic.types.beta import message_count_tokens_params as beta_count_tokens_params
from anthropic.types.beta import message_create_params as beta_message_create_params
from openai.types import chat, responses
from openai.types.chat import completion_create_params
from openai.types.conversations import conversation_create_params, item_create_params
from openai.types.responses import response_create_params, response_output_message_param
from openai.types.shared_params import FunctionDefinition, reasoning
from openai.types.shared_params.response_format_json_schema import JSONSchema
from typing_extensions import is_typeddict

from tests.live_servers import client, model, server  # noqa: F401 (fixtures)


def keys(*typeddicts: Any) -> set[str]:
    return {k for td in typeddicts for k in td.__required_keys__ | td.__optional_keys__}


def _literals(tp: Any) -> set[str]:
    if typing.get_origin(tp) is Literal:
        return set(typing.get_args(tp))
    return {v for arg in typing.get_args(tp) for v in _literals(arg)}


def variants(union: Any, key: str = "type") -> set[str]:
    """The values of ``key`` that tell the members of ``union`` apart (a Literal member: its own values)."""
    found: set[str] = set()
    for member in typing.get_args(union) or (union,):
        if typing.get_origin(member) is Literal:
            found |= set(typing.get_args(member))
        elif is_typeddict(member) and key in keys(member):
            found |= _literals(typing.get_type_hints(member)[key])
    return found


def covered(typeddict: Any, example: dict[str, Any], but: frozenset[str] = frozenset()) -> None:
    """``example`` (sent by a test below) has every key the reference gives ``typeddict``, ``but`` those (refused,
    and tested apart)."""
    missing = keys(typeddict) - set(example) - but
    assert not missing, f"{typeddict.__name__}: no example of {sorted(missing)} (add them to the request types, " \
                        "the docs and this example)"


def known(name: str, *tables: dict[str, Any]) -> None:
    assert any(name in t for t in tables), f"{name!r}: no example here (new in the reference? add it to the " \
                                           "request types and the docs, then here)"


def refused(send: Any, fields: dict[str, Any], param: str) -> None:
    """A 400 whose ``param`` (OpenAI) or message (Anthropic) starts with ``param``."""
    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as err:
        send(fields)
    said = err.value.param if isinstance(err.value, openai.BadRequestError) else err.value.body["error"]["message"]
    assert said is not None and said.startswith(param), err.value.body


def check(name: str, accepted: dict[str, Any], refusals: dict[str, Any], send: Any) -> None:
    """``name``'s example sent: accepted, or a 400 naming it. An example is the request's fields, or a function
    giving them (ids made first)."""
    known(name, accepted, refusals)
    example = accepted.get(name, refusals.get(name))
    fields = example() if callable(example) else example
    if name in accepted:
        send(fields)
    else:
        refused(send, fields, name)


def drain(result: Any) -> None:
    """A stream read to its end (a non-streamed result is whole already)."""
    if isinstance(result, (openai.Stream, anthropic.Stream)):
        for _ in result:
            pass


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


# --- chat completions ------------------------------------------------------------------------------------------
BREAKPOINT = {"mode": "explicit", "ttl": "30m"}
CHAT_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CHAT_MESSAGES = [
    {"role": "system", "content": "Be brief.", "name": "rules"},
    {"role": "developer", "name": "dev",
     "content": [{"type": "text", "text": "Call tools when useful.", "prompt_cache_breakpoint": BREAKPOINT}]},
    {"role": "user", "content": "Weather in Paris?", "name": "ann"},
    {"role": "assistant", "content": None, "tool_calls": [CHAT_CALL], "name": "bot", "refusal": None, "audio": None,
     "function_call": None},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
]
CHAT_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city", "strict": False,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CHAT_JSON_SCHEMA = {"type": "json_schema", "json_schema": {
    "name": "answer", "description": "The answer", "strict": True,
    "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}
CHAT_BASE = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2}
CHAT = {
    "model": {},
    "messages": {"messages": CHAT_MESSAGES, "tools": [CHAT_TOOL]},
    "max_completion_tokens": {"max_completion_tokens": 3},
    "max_tokens": {"max_tokens": 2},
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9},
    "seed": {"seed": 7},
    "stop": {"stop": ["\n\n"]},
    "n": {"n": 1},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    "logprobs": {"logprobs": True},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "tools": {"tools": [CHAT_TOOL]},
    "tool_choice": {"tools": [CHAT_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "parallel_tool_calls": {"tools": [CHAT_TOOL], "tool_choice": "required", "parallel_tool_calls": False},
    "response_format": {"response_format": CHAT_JSON_SCHEMA},
    # accepted at their neutral value only (the engine applies no penalties or bias)
    "frequency_penalty": {"frequency_penalty": 0},
    "presence_penalty": {"presence_penalty": 0},
    "logit_bias": {"logit_bias": {}},
    "modalities": {"modalities": ["text"]},
    # accepted, no effect (or the implicit chain's session key)
    "user": {"user": "user-1"},
    "safety_identifier": {"safety_identifier": "user-1"},
    "prompt_cache_key": {"prompt_cache_key": "session-1"},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "prompt_cache_options": {"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}},
    "metadata": {"metadata": {"app": "test"}},
    "store": {"store": False},
    "service_tier": {"service_tier": "auto"},
    "prediction": {"prediction": {"type": "content", "content": "Hello"}},
    "reasoning_effort": {"reasoning_effort": "medium"},  # a model that does not think: no effect
    "verbosity": {"verbosity": "low"},
}
CHAT_REFUSED = {  # docs/server.md says why
    "audio": {"audio": {"format": "wav", "voice": "alloy"}},
    "web_search_options": {"web_search_options": {"search_context_size": "low"}},
    "moderation": {"moderation": {"model": "omni-moderation-latest"}},
    "functions": {"functions": [CHAT_TOOL["function"]]},
    "function_call": {"function_call": "auto"},
}
# the variants of the request's unions (tests below): accepted ones, refused ones with the field the 400 names
CHAT_PARTS = {"text": {"type": "text", "text": "hi", "prompt_cache_breakpoint": BREAKPOINT}}
CHAT_PARTS_REFUSED = {"image_url": {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}},
                      "input_audio": {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                      "file": {"type": "file", "file": {"file_id": "file_1"}}}
CHAT_TOOL_CHOICES = {"none": "none", "auto": "auto", "required": "required",
                     "function": {"type": "function", "function": {"name": "get_weather"}}}
CHAT_TOOL_CHOICES_REFUSED = {  # send only the allowed tools; custom tools are refused
    "allowed_tools": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}},
    "custom": {"type": "custom", "custom": {"name": "get_weather"}}}
CHAT_FORMATS = {"text": {"type": "text"}, "json_object": {"type": "json_object"}, "json_schema": CHAT_JSON_SCHEMA}


def chat_send(client, model):
    return lambda fields: drain(client.chat.completions.create(model=model, **{**CHAT_BASE, **fields}))


@pytest.mark.parametrize("name", sorted(keys(completion_create_params.CompletionCreateParamsNonStreaming,
                                             completion_create_params.CompletionCreateParamsStreaming)))
def test_chat_completions_field(client, model, name):
    check(name, CHAT, CHAT_REFUSED, chat_send(client, model))


def test_chat_completions_variants(client, model):
    send = chat_send(client, model)
    assert variants(chat.ChatCompletionMessageParam, "role") == {m["role"] for m in CHAT_MESSAGES} | {"function"}
    refused(send, {"messages": [{"role": "function", "name": "f", "content": "1"}]}, "messages[0].role")  # use tool
    for kind in variants(chat.ChatCompletionContentPartParam):
        known(kind, CHAT_PARTS, CHAT_PARTS_REFUSED)
        if kind in CHAT_PARTS:
            send({"messages": [{"role": "user", "content": [CHAT_PARTS[kind]]}]})
        else:  # the model reads text
            refused(send, {"messages": [{"role": "user", "content": [CHAT_PARTS_REFUSED[kind]]}]},
                    "messages[0].content[0].type")
    assert variants(chat.ChatCompletionToolUnionParam) == {"function", "custom"}
    refused(send, {"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools[0].type")
    for kind in variants(chat.ChatCompletionToolChoiceOptionParam):
        known(kind, CHAT_TOOL_CHOICES, CHAT_TOOL_CHOICES_REFUSED)
        if kind in CHAT_TOOL_CHOICES:
            send({"tools": [CHAT_TOOL], "tool_choice": CHAT_TOOL_CHOICES[kind]})
        else:
            refused(send, {"tools": [CHAT_TOOL], "tool_choice": CHAT_TOOL_CHOICES_REFUSED[kind]}, "tool_choice")
    for kind in variants(completion_create_params.ResponseFormat):
        known(kind, CHAT_FORMATS)
        send({"response_format": CHAT_FORMATS[kind]})


def test_chat_completions_examples_cover_the_reference():
    system, developer, user, assistant, tool_message = CHAT_MESSAGES
    covered(chat.ChatCompletionSystemMessageParam, system)
    covered(chat.ChatCompletionDeveloperMessageParam, developer)
    covered(chat.ChatCompletionUserMessageParam, user)
    covered(chat.ChatCompletionAssistantMessageParam, assistant)
    covered(chat.ChatCompletionToolMessageParam, tool_message)
    covered(chat.ChatCompletionMessageFunctionToolCallParam, CHAT_CALL)
    covered(chat.ChatCompletionContentPartTextParam, developer["content"][0])
    covered(chat.ChatCompletionFunctionToolParam, CHAT_TOOL)
    covered(FunctionDefinition, CHAT_TOOL["function"])
    covered(chat.ChatCompletionStreamOptionsParam, CHAT["stream_options"]["stream_options"])
    covered(completion_create_params.PromptCacheOptions, CHAT["prompt_cache_options"]["prompt_cache_options"])
    covered(JSONSchema, CHAT_JSON_SCHEMA["json_schema"])


# --- Responses and Conversations ---------------------------------------------------------------------------------
R_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather for a city", "strict": False,
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
          "allowed_callers": ["direct"], "defer_loading": False, "output_schema": {"type": "object"}, "async": False}
R_USER = {"type": "message", "role": "user", "phase": None,
          "content": [{"type": "input_text", "text": "Weather in Paris?", "prompt_cache_breakpoint": BREAKPOINT}]}
R_REASONING = {"type": "reasoning", "id": "rs_1", "status": "completed", "encrypted_content": None,
               "summary": [{"type": "summary_text", "text": "Look it up."}],
               "content": [{"type": "reasoning_text", "text": "The user asks for the weather."}]}
R_ASSISTANT = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "phase": "commentary",
               "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]}
R_CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
          "arguments": '{"city": "Paris"}', "status": "completed", "caller": {"type": "direct"}, "namespace": None,
          "async": False}
R_OUTPUT = {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": '{"temp_c": 18}',
            "status": "completed", "name": "get_weather", "caller": {"type": "direct"}, "namespace": None}
R_INPUT = [{"type": "message", "role": "developer", "content": "Be brief."}, R_USER, R_REASONING, R_ASSISTANT,
           R_CALL, R_OUTPUT]
R_JSON_SCHEMA = {"type": "json_schema", "name": "answer", "description": "The answer", "strict": True,
                 "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}
R_BASE = {"input": "hi", "max_output_tokens": 2}
RESPONSES = {
    "model": {},
    "input": {"input": R_INPUT, "tools": [R_TOOL]},
    "instructions": {"instructions": "Be brief."},
    "tools": {"tools": [R_TOOL]},
    "tool_choice": {"tools": [R_TOOL], "tool_choice": {"type": "function", "name": "get_weather"}},
    "parallel_tool_calls": {"tools": [R_TOOL], "tool_choice": "required", "parallel_tool_calls": False},
    "max_output_tokens": {"max_output_tokens": 3},
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9},
    "text": {"text": {"format": R_JSON_SCHEMA, "verbosity": "low"}},
    "store": {"store": False},
    "metadata": {"metadata": {"app": "test"}},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_obfuscation": False}},
    "truncation": {"truncation": "disabled"},  # "auto" is refused: a chain is never truncated
    "background": {"background": False},  # true is refused: responses run in the foreground
    "reasoning": {"reasoning": {"effort": "medium", "summary": "auto", "generate_summary": "auto", "context": "auto",
                                "mode": "standard"}},
    "include": {"include": sorted(_literals(responses.ResponseIncludable))},
    "user": {"user": "user-1"},
    "safety_identifier": {"safety_identifier": "user-1"},
    "prompt_cache_key": {"prompt_cache_key": "session-1"},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "prompt_cache_options": {"prompt_cache_options": {"mode": "implicit", "ttl": "30m", "prewarm": False,
                                                      "comparison_response_id": None}},
    "service_tier": {"service_tier": "auto"},
    "max_tool_calls": {"max_tool_calls": 4},
    "context_management": {"context_management": [{"type": "compaction", "compact_threshold": 200_000}]},
    "access_programs": {"access_programs": {"cyber": "standard"}},
    "background_options": {"background_options": {"completion_window": "soonest", "continuation_id": "batch-1"}},
    "image": {"image": {"context_compression": "auto"}},
}
RESPONSES_REFUSED = {  # docs/responses.md says why
    "prompt": {"prompt": {"id": "pmpt_1", "version": "1", "variables": {}}},
    "top_logprobs": {"top_logprobs": 2},
    "moderation": {"moderation": {"model": "omni-moderation-latest"}},
}
R_ITEMS = {"message", "function_call", "function_call_output", "reasoning"}
R_PARTS = {"input_text", "output_text"}
R_TOOL_CHOICES = {"none": "none", "auto": "auto", "required": "required",
                  "function": {"type": "function", "name": "get_weather"}}


def responses_send(client, model):
    return lambda fields: drain(client.responses.create(model=model, **{**R_BASE, **fields}))


@pytest.mark.parametrize("name", sorted(keys(response_create_params.ResponseCreateParamsNonStreaming,
                                             response_create_params.ResponseCreateParamsStreaming)))
def test_responses_field(client, model, name):
    send = responses_send(client, model)
    accepted = {**RESPONSES,
                "previous_response_id": lambda: {"previous_response_id": client.responses.create(
                    model=model, **R_BASE).id, "input": "And Oslo?"},
                "conversation": lambda: {"conversation": {"id": client.conversations.create().id}}}
    check(name, accepted, RESPONSES_REFUSED, send)


def test_responses_variants(client, model):
    send = responses_send(client, model)
    assert R_ITEMS <= {item["type"] for item in R_INPUT}
    # every other variant is refused, naming it: hosted tools' items, item references, images, hosted tools, ...
    for kind in variants(responses.ResponseInputItemParam) - R_ITEMS:
        refused(send, {"input": [R_USER, {"type": kind}]}, "input[1].type")
    parts = variants(responses.ResponseInputContentParam) | variants(response_output_message_param.Content)
    for kind in parts - R_PARTS:  # the model reads text; an assistant's refusal was never made here
        refused(send, {"input": [{"role": "user", "content": [{"type": kind}]}]}, "input[0]")
    for kind in variants(responses.ToolParam) - {"function"}:  # hosted tools
        refused(send, {"tools": [{"type": kind}]}, "tools[0].type")
    for kind in variants(response_create_params.ToolChoice):
        if kind in R_TOOL_CHOICES:
            send({"tools": [R_TOOL], "tool_choice": R_TOOL_CHOICES[kind]})
        else:  # hosted tools; allowed_tools: send only the allowed tools
            refused(send, {"tools": [R_TOOL], "tool_choice": {"type": kind}}, "tool_choice")
    for kind in variants(responses.ResponseFormatTextConfigParam):
        send({"text": {"format": R_JSON_SCHEMA if kind == "json_schema" else {"type": kind}}})


def test_conversations_fields(client, model):
    """POST /v1/conversations and its items: every field of the reference (``include`` is a query parameter)."""
    create = {"items": [{"type": "message", "role": "user", "content": "hi"}], "metadata": {"app": "test"},
              "safety_identifier": "user-1"}
    assert keys(conversation_create_params.ConversationCreateParams) == set(create)
    conversation = client.conversations.create(**create)
    add = {"items": [{"type": "message", "role": "user", "content": "more"}],
           "include": sorted(_literals(responses.ResponseIncludable))}
    assert keys(item_create_params.ItemCreateParams) == set(add)
    client.conversations.items.create(conversation.id, **add)
    client.responses.create(model=model, conversation=conversation.id, **R_BASE)


def test_responses_examples_cover_the_reference():
    covered(responses.EasyInputMessageParam, R_USER)
    covered(responses.ResponseInputTextParam, R_USER["content"][0])
    covered(responses.ResponseReasoningItemParam, R_REASONING)
    covered(responses.ResponseOutputMessageParam, R_ASSISTANT)
    covered(responses.ResponseOutputTextParam, R_ASSISTANT["content"][0])
    covered(responses.ResponseFunctionToolCallParam, R_CALL)
    covered(responses.response_input_item_param.FunctionCallOutput, R_OUTPUT)
    covered(responses.FunctionToolParam, R_TOOL)
    covered(responses.ResponseFormatTextJSONSchemaConfigParam, R_JSON_SCHEMA)
    covered(responses.ResponseTextConfigParam, RESPONSES["text"]["text"])
    covered(reasoning.Reasoning, RESPONSES["reasoning"]["reasoning"])
    covered(response_create_params.PromptCacheOptions, RESPONSES["prompt_cache_options"]["prompt_cache_options"])
    covered(response_create_params.ContextManagement, RESPONSES["context_management"]["context_management"][0])
    covered(response_create_params.BackgroundOptions, RESPONSES["background_options"]["background_options"])
    covered(response_create_params.AccessPrograms, RESPONSES["access_programs"]["access_programs"])
    covered(response_create_params.Image, RESPONSES["image"]["image"])
    covered(response_create_params.StreamOptions, RESPONSES["stream_options"]["stream_options"])


# --- Anthropic's Messages ----------------------------------------------------------------------------------------
CACHE = {"type": "ephemeral", "ttl": "5m"}
A_TOOL = {"name": "get_weather", "description": "Current weather for a city", "type": "custom",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}, "cache_control": CACHE,
          "strict": True, "allowed_callers": ["direct"], "defer_loading": False, "eager_input_streaming": None,
          "input_examples": [{"city": "Paris"}]}
A_TEXT = {"type": "text", "text": "Weather in Paris?", "cache_control": CACHE, "citations": None}
A_TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"},
              "cache_control": CACHE, "caller": {"type": "direct"}, "toolset_name": None}
A_TOOL_RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}],
                 "is_error": False, "cache_control": CACHE, "toolset_name": None}
A_MESSAGES = [{"role": "user", "content": [A_TEXT]}, {"role": "assistant", "content": [A_TOOL_USE]},
              {"role": "user", "content": [A_TOOL_RESULT]}]
A_EDITS = {
    "clear_tool_uses_20250919": {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1},
                                 "keep": {"type": "tool_uses", "value": 1}, "clear_at_least": {"type": "input_tokens",
                                                                                               "value": 0},
                                 "exclude_tools": [], "clear_tool_inputs": True},
    "clear_thinking_20251015": {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
    "compact_20260112": {"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 150_000},
                         "instructions": "Keep the numbers.", "pause_after_compaction": False},
}
A_THINKING = {  # a model that thinks turns it on or off (tests/server/test_reasoning.py); this one does not think
    "enabled": {"type": "enabled", "budget_tokens": 1024, "display": "omitted",
                "block_binding": {"prefix_mismatch_behavior": "drop_block"}},
    "disabled": {"type": "disabled"},
    "between_tools": {"type": "between_tools"},
    "adaptive": {"type": "adaptive", "display": "summarized", "block_binding": {}},
}
A_OUTPUT_CONFIG = {"effort": "high", "task_budget": {"type": "tokens", "total": 100_000, "remaining": 90_000}}
A_BASE = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MESSAGES = {
    "model": {},
    "max_tokens": {"max_tokens": 3},
    "messages": {"messages": A_MESSAGES, "tools": [A_TOOL]},
    "system": {"system": [{"type": "text", "text": "Be brief.", "cache_control": CACHE, "citations": None}]},
    "tools": {"tools": [A_TOOL]},
    "tool_choice": {"tools": [A_TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
    "stop_sequences": {"stop_sequences": ["\n\n"]},
    "stream": {"stream": True},
    "metadata": {"metadata": {"user_id": "user-1"}},
    "thinking": {"thinking": A_THINKING["adaptive"]},
    "context_management": {"context_management": {"edits": list(A_EDITS.values())}},
    "cache_control": {"cache_control": CACHE},
    "service_tier": {"service_tier": "auto"},
    "output_config": {"output_config": A_OUTPUT_CONFIG},
    "speed": {"speed": "fast"},
    "inference_geo": {"inference_geo": "us"},
    "diagnostics": {"diagnostics": {"previous_message_id": None}},
    "fallbacks": {"fallbacks": "default"},
    "fallback_credit_token": {"fallback_credit_token": "token"},
    "billing_policy": {"billing_policy": {"type": "billing_policy", "bill_to": "self"}},
    # headers: anthropic-beta, anthropic-user-profile-id, anthropic-workspace-id (accepted, no effect)
    "betas": {"betas": ["context-management-2025-06-27", "interleaved-thinking-2025-05-14"]},
    "user_profile_id": {"user_profile_id": "uprof_1"},
    "workspace_id": {"workspace_id": "wrkspc_1"},
}
MESSAGES_REFUSED = {  # docs/anthropic.md says why
    "container": {"container": {"id": "container_1"}},
    "mcp_servers": {"mcp_servers": [{"type": "url", "url": "https://mcp.test/sse", "name": "test"}]},
    "compaction": {"compaction": {"type": "summarize", "instructions": "Keep the numbers."}},
    "thread": {"thread": {"type": "create"}},
}
COUNT_TOKENS = {**{k: v for k, v in MESSAGES.items() if k != "max_tokens"},
                "compaction": {"compaction": {"type": "summarize"}}}  # ignored, as Anthropic's count_tokens does
A_BLOCKS = {"text", "tool_use", "tool_result"}
A_BLOCKS_REFUSED = {"thinking": {"type": "thinking", "thinking": "Hm.", "signature": "sig"},  # whole, to be refused
                    "redacted_thinking": {"type": "redacted_thinking", "data": "opaque"}}  # by type


def messages_send(claude, model, beta: bool, count: bool = False):
    api = claude.beta.messages if beta else claude.messages
    call, base = (api.count_tokens, {"messages": A_BASE["messages"]}) if count else (api.create, A_BASE)
    return lambda fields: drain(call(model=model, **{**base, **fields}))


@pytest.mark.parametrize("name", sorted(keys(message_create_params.MessageCreateParamsNonStreaming,
                                             message_create_params.MessageCreateParamsStreaming,
                                             beta_message_create_params.MessageCreateParamsNonStreaming,
                                             beta_message_create_params.MessageCreateParamsStreaming)))
def test_messages_field(claude, model, name):
    beta = name not in keys(message_create_params.MessageCreateParamsNonStreaming,
                            message_create_params.MessageCreateParamsStreaming)
    check(name, MESSAGES, MESSAGES_REFUSED, messages_send(claude, model, beta))


@pytest.mark.parametrize("name", sorted(keys(message_count_tokens_params.MessageCountTokensParams,
                                             beta_count_tokens_params.MessageCountTokensParams)))
def test_count_tokens_field(claude, model, name):
    beta = name not in keys(message_count_tokens_params.MessageCountTokensParams)
    check(name, COUNT_TOKENS, MESSAGES_REFUSED, messages_send(claude, model, beta, count=True))


def test_messages_variants(claude, model):
    send, send_beta = messages_send(claude, model, False), messages_send(claude, model, True)
    assert variants(anthropic.types.MessageParam, "role") == {"user", "assistant", "system"}
    # system messages that open the conversation join `system` (the chat template renders one system prompt)
    send({"system": "S", "messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "system", "content": [{"type": "text", "text": "Really."}]},
                                      *A_BASE["messages"]]})
    refused(send, {"messages": [*A_BASE["messages"], {"role": "assistant", "content": "ok"},
                                {"role": "system", "content": "Later."}, {"role": "user", "content": "hi"}]},
            "messages[2].role")
    assert A_BLOCKS <= {b["type"] for m in A_MESSAGES for b in m["content"]}
    blocks = variants(anthropic.types.ContentBlockParam) | variants(anthropic_beta.BetaContentBlockParam)
    for kind in blocks - A_BLOCKS:  # images, documents, server tools' blocks; thinking: this model has none
        block = A_BLOCKS_REFUSED.get(kind, {"type": kind})
        refused(send_beta, {"messages": [A_MESSAGES[0], {"role": "assistant", "content": [block]},
                                         A_MESSAGES[0]]}, "messages[1].content[0].type")
    tools = variants(anthropic.types.ToolUnionParam) | variants(anthropic_beta.BetaToolUnionParam)
    for kind in tools - {"custom"}:  # server tools
        refused(send_beta, {"tools": [{"type": kind, "name": "x"}]}, "tools[0]")
    for kind in variants(anthropic.types.ThinkingConfigParam) | variants(anthropic_beta.BetaThinkingConfigParam):
        known(kind, A_THINKING)
        send_beta({"thinking": A_THINKING[kind]})
    for kind in variants(typing.get_type_hints(anthropic_beta.BetaContextManagementConfigParam)["edits"]):
        known(kind, A_EDITS)
        send_beta({"context_management": {"edits": [A_EDITS[kind]]}})
    for kind in variants(anthropic.types.ToolChoiceParam):
        send({"tools": [A_TOOL], "tool_choice": {"type": kind, **({"name": "get_weather"} if kind == "tool" else {})}})
    send({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})  # structured outputs
    refused(send, {"output_config": {"format": {"type": "json_schema", "schema": {"type": "no-such-type"}}}},
            "output_config.format.schema")


def test_messages_examples_cover_the_reference():
    for tool in (anthropic.types.ToolParam, anthropic_beta.BetaToolParam):
        covered(tool, A_TOOL)
    for text in (anthropic.types.TextBlockParam, anthropic_beta.BetaTextBlockParam):
        covered(text, A_TEXT)
    for use in (anthropic.types.ToolUseBlockParam, anthropic_beta.BetaToolUseBlockParam):
        covered(use, A_TOOL_USE)
    for result in (anthropic.types.ToolResultBlockParam, anthropic_beta.BetaToolResultBlockParam):
        covered(result, A_TOOL_RESULT)
    covered(anthropic.types.CacheControlEphemeralParam, CACHE)
    covered(anthropic_beta.BetaThinkingConfigEnabledParam, A_THINKING["enabled"])
    covered(anthropic_beta.BetaThinkingConfigAdaptiveParam, A_THINKING["adaptive"])
    covered(anthropic_beta.BetaClearToolUses20250919EditParam, A_EDITS["clear_tool_uses_20250919"])
    covered(anthropic_beta.BetaClearThinking20251015EditParam, A_EDITS["clear_thinking_20251015"])
    covered(anthropic_beta.BetaCompact20260112EditParam, A_EDITS["compact_20260112"])
    covered(anthropic_beta.BetaOutputConfigParam, A_OUTPUT_CONFIG, but=frozenset({"format"}))
    covered(anthropic.types.MetadataParam, MESSAGES["metadata"]["metadata"])
    covered(anthropic.types.ToolChoiceAnyParam, MESSAGES["tool_choice"]["tool_choice"])
