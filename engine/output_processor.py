"""From sampled tokens to what a request returns: stop handling, detokenization and ``RequestOutput`` deltas.

The engine's live requests are here, each with its incremental detokenizer. A sampled token is appended to its
request, advances its grammar, and is detokenized; the request finishes on a stop token, a stop string (the
text is cut at it), its grammar's end, or its length. A finished request's KV goes to its chain (if it has
one) or back to the pool, its method forgets it, and after its last output the engine forgets it too. The plain
step and the decode-window path take tokens through the same calls, so a window's outputs equal single steps'.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.chain_manager import ChainManager
from engine.detokenizer import IncrementalDetokenizer, decoder_for
from engine.method_set import MethodSet
from engine.outputs import RequestOutput
from engine.request import FinishReason, Request
from engine.sampler import TopLogprobs
from engine.scheduler import Scheduler
from engine.structured_output import advance


class OutputProcessor:
    def __init__(self, tokenizer, decode: Callable, scheduler: Scheduler, chains: ChainManager, methods: MethodSet):
        """``decode``: what every request's detokenizer decodes with (``engine.detokenizer.decoder_for``); a
        request that keeps special tokens (``SamplingParams.skip_special_tokens`` False) decodes with them."""
        self.tokenizer = tokenizer
        self.decode = decode
        self.decode_special = decoder_for(tokenizer, skip_special_tokens=False)
        self.scheduler = scheduler
        self.chains = chains
        self.methods = methods
        self.requests: dict[str, Request] = {}  # every request added and not yet forgotten, by id
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.methods.hold(req.method)  # dropped in forget: a retained configuration outlives its running requests
        decode = self.decode if req.params.skip_special_tokens else self.decode_special
        self.detokenizers[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.num_prompt_tokens,
                                                                   decode=decode)

    def text_length(self, req: Request) -> int:
        """Characters of text ``req`` has generated so far (where the next delta starts)."""
        return len(self.detokenizers[req.request_id].text)

    def append_token(self, req: Request, token_id: int, logprob: float | None,
                     top: TopLogprobs | None) -> RequestOutput:
        """Take one sampled token and return the request's delta."""
        before = self.text_length(req)
        return self.emit(req, [token_id], before, self.accept_token(req, token_id, logprob, top))

    def accept_token(self, req: Request, token_id: int, logprob: float | None,
                     top: TopLogprobs | None) -> str | int | None:
        """Append one sampled token; finish the request if it stops (its grammar ending included) or reaches its
        length (its stop reason)."""
        req.append_output(token_id, logprob, top)
        grammar_ended = req.grammar is not None and advance(req.grammar, token_id)
        detok = self.detokenizers[req.request_id]
        stop_token = req.stop_by_token(token_id)
        # the stop token is no part of the text, also where special tokens are kept
        delta = detok.update(req.token_ids[:-1] if stop_token and not req.params.skip_special_tokens else
                             req.token_ids)
        stop_reason: str | int | None = None
        if stop_token:
            stop_reason = token_id
        elif (stop := detok.truncate_at_stop(req.params.stop, len(delta), req.params.include_stop_str_in_output)):
            stop_reason = stop
        if stop_reason is not None or grammar_ended:
            self.finish(req, FinishReason.STOP)
        elif req.reached_length_limit():
            self.finish(req, FinishReason.LENGTH)
        return stop_reason

    def emit(self, req: Request, new_ids: list[int], text_before: int, stop_reason) -> RequestOutput:
        """The delta of ``new_ids`` (text from ``text_before`` on); a finished request is then forgotten."""
        out = self.output(req, new_ids, self.detokenizers[req.request_id].text[text_before:], stop_reason)
        if req.is_finished:
            self.forget(req)
        return out

    def abort(self, req: Request) -> RequestOutput:
        self.finish(req, FinishReason.ABORT)
        out = self.output(req, [], "")
        self.forget(req)
        return out

    def finish(self, req: Request, reason: FinishReason) -> None:
        if req.chain_id is not None:
            self.chains.retain(req, reason)
        self.scheduler.finish(req, reason)
        req.method.release(req)

    def forget(self, req: Request) -> None:
        del self.requests[req.request_id]
        self.methods.drop(req.method)
        del self.detokenizers[req.request_id]

    def output(self, req: Request, new_ids: list[int], new_text: str, stop_reason=None) -> RequestOutput:
        text = self.detokenizers[req.request_id].text
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            text=text,
            finished=req.is_finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            new_token_ids=new_ids,
            new_text=new_text,
            logprobs=list(req.output_logprobs) if req.params.logprobs else None,
            top_logprobs=list(req.output_top_logprobs) if req.params.top_logprobs else None,
            stop_reason=stop_reason,
            chain_id=req.chain_id,
            resume_status=req.resume_status,
            num_prefilled_tokens=req.num_prefilled_tokens,
            num_resumed_tokens=req.num_resumed_tokens,
        )
