"""API keys and tenants.

A key reads ``art_<key_id>_<secret>``. The ``api_keys`` table keeps the key id, the tenant, a random salt and
``sha256(salt + secret)``, never the key itself (the secret is 256 random bits, so a fast salted hash is
enough; there is nothing to brute-force). Requests carry ``Authorization: Bearer <key>``; the guard resolves
the tenant and every chain route is scoped to it (another tenant's chain is a 404, never a 403).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

import msgspec
from litestar.connection import ASGIConnection
from litestar.enums import ScopeType
from litestar.exceptions import HTTPException, NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from sqlalchemy import func, select, update

from agentrt.db import Database
from agentrt.errors import on_http_error
from agentrt.models import LOCAL_TENANT, ApiKeyRow

KEY_PREFIX = "art_"
TENANT_SCOPE_KEY = "agentrt.tenant"
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
_KEY = re.compile(r"^art_([0-9a-f]{16})_([A-Za-z0-9_-]{20,128})$")


class InvalidTenant(ValueError):
    pass


@dataclass(slots=True, frozen=True)
class CreatedKey:
    key_id: str
    tenant: str
    key: str  # shown once; only its hash is stored


def _hash(salt: bytes, secret: str) -> bytes:
    return hashlib.sha256(salt + secret.encode()).digest()


def check_tenant(tenant: str) -> str:
    if not _TENANT.match(tenant):
        raise InvalidTenant(f"tenant names are 1-128 characters of letters, digits and . _ @ - "
                            f"(starting with a letter or digit), not {tenant!r}")
    return tenant


class KeyService:
    def __init__(self, db: Database):
        self.db = db

    async def create(self, tenant: str, name: str | None = None) -> CreatedKey:
        check_tenant(tenant)
        key_id, secret, salt = secrets.token_hex(8), secrets.token_urlsafe(32), secrets.token_bytes(16)
        async with self.db.sessions.begin() as s:
            s.add(ApiKeyRow(key_id=key_id, tenant=tenant, salt=salt, key_hash=_hash(salt, secret),
                            created_at=time.time(), name=name))
        return CreatedKey(key_id=key_id, tenant=tenant, key=f"{KEY_PREFIX}{key_id}_{secret}")

    async def revoke(self, key_id: str) -> bool:
        async with self.db.sessions.begin() as s:
            result = await s.execute(update(ApiKeyRow).where(ApiKeyRow.key_id == key_id,
                                                             ApiKeyRow.revoked_at.is_(None))
                                     .values(revoked_at=time.time()))
        return bool(getattr(result, "rowcount", 0))

    async def list(self, tenant: str | None = None) -> list[ApiKeyRow]:
        query = select(ApiKeyRow).order_by(ApiKeyRow.created_at)
        if tenant is not None:
            query = query.where(ApiKeyRow.tenant == tenant)
        async with self.db.sessions() as s:
            return list((await s.scalars(query)).all())

    async def count_active(self) -> int:
        async with self.db.sessions() as s:
            return await s.scalar(select(func.count()).select_from(ApiKeyRow)
                                  .where(ApiKeyRow.revoked_at.is_(None))) or 0

    async def tenant_of(self, key: str) -> str | None:
        """The tenant of a valid, unrevoked key; None otherwise."""
        m = _KEY.match(key)
        if m is None:
            return None
        key_id, secret = m.groups()
        async with self.db.sessions() as s:
            row = await s.get(ApiKeyRow, key_id)
        if row is None or row.revoked_at is not None or not hmac.compare_digest(row.key_hash, _hash(row.salt, secret)):
            return None
        return row.tenant

    async def authenticate(self, authorization: str | None, required: bool) -> str:
        """The tenant for an ``Authorization`` header value. Without auth required, a request without an
        agentrt key (no header, or a placeholder such as the OpenAI client's) is the ``local`` tenant; an
        ``art_`` key is still checked."""
        token = None
        if authorization:
            scheme, _, value = authorization.strip().partition(" ")
            token = value.strip() if scheme.lower() == "bearer" else None
            if token is None and required:
                raise _unauthorized("the Authorization header must be `Bearer <API key>`")
        if not token or (not required and not token.startswith(KEY_PREFIX)):
            if required:
                raise _unauthorized("an API key is required: send `Authorization: Bearer <key>` "
                                    "(create one with `agentrt keys create --tenant NAME`)")
            return LOCAL_TENANT
        tenant = await self.tenant_of(token)
        if tenant is None:
            raise _unauthorized("invalid or revoked API key")
        return tenant


def _unauthorized(detail: str) -> NotAuthorizedException:
    return NotAuthorizedException(detail=detail, headers={"WWW-Authenticate": 'Bearer realm="agentrt"'})


async def auth_guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """App-wide guard (runs before the body is parsed); handlers with ``opt={"public": True}`` skip it."""
    if handler.opt.get("public"):
        return
    state = connection.app.state
    connection.scope[TENANT_SCOPE_KEY] = await state.api_keys.authenticate(  # type: ignore[literal-required]
        connection.headers.get("authorization"), state.config.auth_required)


_REFUSAL_SCOPE_KEY = "agentrt.websocket_refusal"


class WebSocketDenial(ASGIMiddleware):
    """A WebSocket handshake that a guard refuses is answered with the HTTP status and error body of the same
    refusal on an HTTP route: 401 with ``WWW-Authenticate`` for a missing or invalid key, 400 for a ``Host`` the
    server does not answer to.

    A handshake can be refused only before it is accepted, and an ASGI app that closes the socket then gets a bare
    403 from its server (uvicorn, hypercorn): ASGI's ``websocket.close`` carries no status. The ASGI "WebSocket
    Denial Response" extension (``websocket.http.response``, which uvicorn offers) lets the app send the response
    itself. Litestar answers a guard's exception on a WebSocket by closing it (in its exception middleware, inside
    this one), so ``record`` (an ``after_exception`` hook) keeps the exception in the scope and this middleware
    turns that close into the response. Under a server without the extension (Litestar's TestClient) the close
    gets the code 4000 + the status (4401, 4400) and the detail as its reason."""

    scopes = (ScopeType.WEBSOCKET,)

    @staticmethod
    async def record(exc: BaseException, scope: Scope) -> None:
        if scope["type"] == ScopeType.WEBSOCKET and isinstance(exc, HTTPException):
            scope[_REFUSAL_SCOPE_KEY] = exc  # type: ignore[literal-required]

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        accepted = False

        async def deny_or_send(message: Message) -> None:
            nonlocal accepted
            refusal = scope.get(_REFUSAL_SCOPE_KEY)  # type: ignore[call-overload]
            if message["type"] == "websocket.close" and not accepted and refusal is not None:
                await _deny(scope, send, refusal)
                return
            accepted = accepted or message["type"] == "websocket.accept"
            await send(message)

        await next_app(scope, receive, deny_or_send)


async def _deny(scope: Scope, send: Send, exc: HTTPException) -> None:
    if "websocket.http.response" not in (scope.get("extensions") or {}):
        reason = exc.detail.encode()[:123].decode(errors="ignore")  # a close frame's reason holds 123 bytes
        await send({"type": "websocket.close", "code": 4000 + exc.status_code, "reason": reason})
        return
    body = msgspec.json.encode(on_http_error(None, exc).content)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (exc.headers or {}).items()]
    await send({"type": "websocket.http.response.start", "status": exc.status_code, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body, "more_body": False})
