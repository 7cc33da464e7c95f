"""Incremental detokenization and stop strings.

Each update decodes only the tokens since the previous read offset (the vLLM prefix/read-offset scheme), so
a step costs O(new tokens), and text is held back while the tail is an incomplete UTF-8 sequence.
"""

from dataclasses import dataclass

INCOMPLETE = "\ufffd"


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: object
    prompt_len: int
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self) -> None:
        self.prefix_offset = self.read_offset = self.prompt_len

    def update(self, token_ids: list[int]) -> str:
        """Feed the request's full token list; returns the text added since the last call."""
        decode = self.tokenizer.decode
        prefix_text = decode(token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        new_text = decode(token_ids[self.prefix_offset:], skip_special_tokens=True)
        if len(new_text) <= len(prefix_text) or new_text.endswith(INCOMPLETE):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self.text += delta
        return delta

    def truncate_at_stop(self, stops: list[str], delta_len: int, include: bool) -> str | None:
        """If a stop string appears in the newest text, cut ``text`` there and return that stop string."""
        if not stops or delta_len == 0:
            return None
        search_from = max(0, len(self.text) - delta_len - max(map(len, stops)) + 1)
        found = [(idx, s) for s in stops if (idx := self.text.find(s, search_from)) != -1]
        if not found:
            return None
        idx, stop = min(found)
        self.text = self.text[: idx + len(stop) if include else idx]
        return stop
