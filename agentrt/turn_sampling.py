"""A turn request's sampling options as the engine's parameters, checked against the server's limits (400 naming
the field at fault) before anything about the chain changes."""

from __future__ import annotations

from typing import Any

from agentrt.errors import bad_field
from agentrt.structured_spec import structured_spec
from agentrt.tool_syntax import ToolSyntax
from engine.sampling_params import SamplingParams
from sdk.schema import TurnCreate


def turn_sampling(data: TurnCreate, tools: list[dict[str, Any]] | None, max_tokens_per_turn: int,
                  vocab: int, syntax: ToolSyntax, keep_special_tokens: bool = False) -> SamplingParams:
    """The turn's engine parameters; ``tools``: the chain's, which ``sampling.tool_choice`` chooses among, calls
    spelled in the model's ``syntax``; ``keep_special_tokens``: the model's tags are special tokens, which the
    text must keep (``ChatRenderer.keeps_special_tokens``)."""
    s = data.sampling
    max_tokens = s.max_tokens
    if max_tokens > max_tokens_per_turn:
        if not s.fit_max_tokens:
            raise bad_field("sampling.max_tokens", f"must be <= {max_tokens_per_turn} (or set "
                                                   "sampling.fit_max_tokens)")
        max_tokens = max_tokens_per_turn
    if len(s.forced_token_ids) > max_tokens:
        raise bad_field("sampling.forced_token_ids", f"has {len(s.forced_token_ids)} tokens, more than "
                                                     f"sampling.max_tokens ({max_tokens})")
    if any(t >= vocab for t in s.forced_token_ids):
        raise bad_field("sampling.forced_token_ids", f"every id must be < the vocabulary size {vocab}")
    structured, _ = structured_spec(s.response_format, s.tool_choice, tools, s.parallel_tool_calls, syntax,
                                    prefix="sampling.", tools_key="sampling.tool_choice")
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=s.seed,
                          max_tokens=max_tokens, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
                          ignore_eos=s.ignore_eos, forced_token_ids=list(s.forced_token_ids),
                          structured=structured, fit_max_tokens=s.fit_max_tokens,
                          skip_special_tokens=not keep_special_tokens)

