"""Request bodies read as strictly as WebSocket frames are.

Litestar converts a route's ``data`` with msgspec's lax rules (``"10"`` and ``4e0`` become ints, ``"false"``
and ``0`` bools) and parses any content type as JSON. Before a handler with a ``data`` parameter runs, this
hook requires a JSON content type (415 otherwise) and decodes the body with msgspec's strict rules against the
handler's own ``data`` type, so the HTTP routes accept exactly what the WebSocket and the published schema
accept. A body that passes is then converted by Litestar as before, with the same result.
"""

from __future__ import annotations

import re

import msgspec
from litestar import Request
from litestar.exceptions import HTTPException, ValidationException

_AT = re.compile(r" - at `\$\.?(.*)`$")


class UnsupportedMediaType(HTTPException):
    status_code = 415


def _is_json(media_type: str) -> bool:
    media_type = media_type.lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


async def strict_json_body(request: Request) -> None:
    field = request.route_handler.parsed_fn_signature.parameters.get("data")
    if field is None:
        return
    body = await request.body()
    if not body and field.is_optional:
        return
    media_type = request.content_type[0]
    if not _is_json(media_type):
        shown = media_type or "none"
        raise UnsupportedMediaType(detail=f"the request body must be JSON (Content-Type: application/json); "
                                          f"got {shown!r}")
    try:
        msgspec.json.decode(body, type=field.annotation, strict=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _AT.search(text)
        message = text[: m.start()] if m else text
        item = {"message": message, "source": "body"}
        if m and m.group(1):
            item["key"] = m.group(1)
        raise ValidationException(detail=message, extra=[item]) from None
    except msgspec.DecodeError:
        return  # malformed JSON: Litestar's own parse answers it, as before
