"""The ``Host`` allow-list: a keyless server on a loopback address answers only to loopback names.

Without API keys, anything that reaches the port can run turns. A browser page from another site reaches a
loopback port through DNS rebinding (its own name made to resolve to 127.0.0.1): the requests then carry that
site's name in ``Host``, which this guard refuses (400 naming the header). Cross-origin "simple" requests are
refused earlier (bodies must be ``application/json``, which needs a CORS preflight that this server never
grants: CORS stays off).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException
from litestar.handlers.base import BaseRouteHandler

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class DisallowedHost(HTTPException):
    status_code = 400


def host_name(header: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:8000`` -> ``::1``), lower case."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1: header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _is_loopback_ip(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _allowed(name: str, allowed: frozenset[str]) -> bool:
    if name in allowed or ("localhost" in allowed and (_is_loopback_ip(name) or name.endswith(".localhost"))):
        return True
    return any(a.startswith("*.") and name.endswith(a[1:]) for a in allowed)


def host_guard(allowed_hosts: Iterable[str]):
    """A Litestar guard refusing a connection whose ``Host`` is not in ``allowed_hosts`` (names or ``*.domain``;
    ``localhost`` also admits every loopback address and ``*.localhost``)."""
    allowed = frozenset(h.lower().strip("[]") for h in allowed_hosts)
    shown = ", ".join(sorted(allowed))

    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        header = connection.headers.get("host", "")
        if not _allowed(host_name(header), allowed):
            raise DisallowedHost(detail=f"Host: {header!r} is not a name this server answers to ({shown}); "
                                        "a server without API keys answers only to loopback names: start it "
                                        "with --allowed-host NAME to add one")
    return guard
