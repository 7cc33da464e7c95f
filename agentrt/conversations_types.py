"""The Conversations API's wire types (agentrt.conversations, agentrt.routes.conversations): the request bodies,
which refuse unknown fields, the objects it returns, and its 404s.
"""

from __future__ import annotations

from typing import Annotated, Any

from litestar.exceptions import NotFoundException
from msgspec import Meta, Struct

MAX_ITEMS = 20  # per request, as OpenAI's


class _In(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


# OpenAI's metadata: at most 16 pairs, keys up to 64 characters, values up to 512
Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
                     Meta(max_length=16)]


class ConversationCreate(_In):
    items: Annotated[list[dict[str, Any]], Meta(max_length=MAX_ITEMS)] | None = None
    metadata: Metadata | None = None
    safety_identifier: str | None = None  # accepted, no effect


class ConversationUpdate(_In):
    metadata: Metadata | None  # required (OpenAI's); null clears it


class ItemsCreate(_In):
    items: Annotated[list[dict[str, Any]], Meta(min_length=1, max_length=MAX_ITEMS)]


class ConversationObject(Struct, kw_only=True):
    id: str
    created_at: int
    metadata: dict[str, str]
    object: str = "conversation"


class ConversationDeleted(Struct, kw_only=True):
    id: str
    deleted: bool = True
    object: str = "conversation.deleted"


class ConversationItemList(Struct, kw_only=True):
    """A page of a conversation's items (OpenAI's ``ConversationItemList``; ``first_id`` / ``last_id`` null on an
    empty page)."""

    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool = False
    object: str = "list"


class ConversationNotFound(NotFoundException):
    def __init__(self, conversation_id: str):
        super().__init__(detail=f"no conversation with the id {conversation_id!r}")


class ItemNotFound(NotFoundException):
    def __init__(self, item_id: str, conversation_id: str):
        super().__init__(detail=f"no item with the id {item_id!r} in the conversation {conversation_id!r}")
