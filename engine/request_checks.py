"""The checks a new request passes before the engine queues it.

``LLMEngine.add_request`` runs them in order, before anything of the request is held (a bad request leaves the
engine as it was): its sampling parameters, its prompt (tokenized, in the vocabulary, leaving room to generate
within ``max_model_len``), and whether its KV could ever fit the pool, so that an idle engine always makes
progress (the scheduler never waits for pages a request can never get).
"""

from __future__ import annotations

from engine.contract.method import SparseMethod
from engine.errors import InvalidRequestError, InvalidSamplingParamsError
from engine.page_pool import PagePool
from engine.sampling_params import SamplingParams


class RequestChecks:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, page_size: int, max_num_batched_tokens: int,
                 pool: PagePool):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.page_size = page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pool = pool

    def sampling_params(self, params: SamplingParams | None) -> SamplingParams:
        """``params``, or the defaults for None."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidSamplingParamsError(f"params must be SamplingParams, got {type(params).__name__}")
        return params

    def prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            vocab = self.vocab_size
            bad = next((t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab),
                       None)
            if bad is not None:
                raise InvalidRequestError(f"prompt token id {bad!r} is not an int in [0, {vocab})")
        else:
            raise InvalidRequestError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                "(at least one token must be left to generate)"
            )
        return token_ids

    def forced_token_ids(self, params: SamplingParams) -> None:
        vocab = self.vocab_size
        if any(t >= vocab for t in params.forced_token_ids):
            raise InvalidSamplingParamsError(f"forced_token_ids must be < the vocabulary size {vocab}")

    def fits_pool(self, method: SparseMethod, num_prompt_tokens: int, params: SamplingParams, chained: bool) -> None:
        """The most KV the request may hold at once under ``method`` (``max_physical_tokens``), in pages, fits
        the whole pool; ``chained``: a chain turn, which may copy a forked chain's tail page."""
        max_new = min(params.max_tokens, self.max_model_len - num_prompt_tokens)
        pages, held = self._pages(method, num_prompt_tokens, max_new, chained)
        if pages > self.pool.num_pages:
            raise InvalidRequestError(
                f"request needs up to {pages} KV pages ({held} tokens held at once) but the pool has "
                f"{self.pool.num_pages}"
            )

    def fitted_max_tokens(self, method: SparseMethod, num_prompt_tokens: int, params: SamplingParams,
                          chained: bool) -> int:
        """``params.max_tokens`` lowered to the most new tokens the context and the pool can hold for the prompt
        (``SamplingParams.fit_max_tokens``); at least 1, where ``fits_pool`` then refuses a prompt that does not
        fit at all."""
        hi = min(params.max_tokens, self.max_model_len - num_prompt_tokens)
        if self._pages(method, num_prompt_tokens, hi, chained)[0] <= self.pool.num_pages:
            return hi
        lo = 1  # the held KV grows with the new tokens: the largest count that fits, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._pages(method, num_prompt_tokens, mid, chained)[0] <= self.pool.num_pages:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _pages(self, method: SparseMethod, num_prompt_tokens: int, max_new: int, chained: bool) -> tuple[int, int]:
        held = min(num_prompt_tokens + max_new, method.max_physical_tokens(
            num_prompt_tokens, max_new, self.max_num_batched_tokens))
        return -(-held // self.page_size) + chained, held  # a forked chain's tail page copy
