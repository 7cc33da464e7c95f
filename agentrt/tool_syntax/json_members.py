"""Where a member's value lies in a JSON object's text (the span a pruning of a call's arguments takes)."""

from __future__ import annotations

import json
import re

_WS = re.compile(r"\s*")
_JSON = json.JSONDecoder()


def member_span(body: str, key: str) -> tuple[int, int] | None:
    """The character span of the value of ``key`` in the JSON object ``body`` (the last one, as ``json.loads``
    takes it); None when there is none or ``body`` is no object."""
    found = None
    try:
        i = _WS.match(body, 0).end()  # type: ignore[union-attr]
        if body[i] != "{":
            return None
        i = _WS.match(body, i + 1).end()  # type: ignore[union-attr]
        if body[i] == "}":
            return None
        while True:
            if body[i] != '"':
                return None
            name, i = json.decoder.scanstring(body, i + 1)  # type: ignore[attr-defined]
            i = _WS.match(body, i).end()  # type: ignore[union-attr]
            if body[i] != ":":
                return None
            i = _WS.match(body, i + 1).end()  # type: ignore[union-attr]
            _, end = _JSON.raw_decode(body, i)
            if name == key:
                found = (i, end)
            i = _WS.match(body, end).end()  # type: ignore[union-attr]
            if body[i] == "}":
                return found
            if body[i] != ",":
                return None
            i = _WS.match(body, i + 1).end()  # type: ignore[union-attr]
    except (ValueError, IndexError):
        return None
