"""OpenAI's Conversations API: POST /v1/conversations, GET / POST (update) / DELETE /v1/conversations/{id}, and its
items: GET / POST /v1/conversations/{id}/items, GET / DELETE /v1/conversations/{id}/items/{item_id}, over chains
(agentrt.conversations). Every error is OpenAI's error object."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from litestar import Controller, delete, get, post
from litestar.datastructures import State
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter

from agentrt.conversations import conversations_service
from agentrt.conversations_types import (ConversationCreate, ConversationDeleted, ConversationItemList,
                                         ConversationObject, ConversationUpdate, ItemsCreate)
from agentrt.errors import OPENAI_EXCEPTION_HANDLERS
from agentrt.openapi import CREATES, REQUEST_EXAMPLES, openai_errors

Tenant = NamedDependency[str]
_UNKNOWN = "No conversation with this id for this tenant (another tenant's, deleted, or never made)"
_ITEM = "No such conversation for this tenant, or no item with this id in it"
# accepted, no effect: what OpenAI's `include` adds (logprobs, image urls, ...) this server does not keep; the
# values are OpenAI's (another is a 400 naming `include`)
Includable = Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                     "message.input_image.image_url", "computer_call_output.output.image_url",
                     "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"]
Include = FromQuery[list[Includable] | None]
_HELLO = {"type": "message", "role": "user", "content": "Hello!"}


class ConversationsController(Controller):
    path = "/v1/conversations"
    exception_handlers = OPENAI_EXCEPTION_HANDLERS

    @post("/", status_code=200, opt={CREATES: "conversation_id", REQUEST_EXAMPLES: {
        "empty": {}, "an item and metadata": {"items": [_HELLO], "metadata": {"topic": "demo"}}}},
          responses=openai_errors(429, descriptions={
              429: "Over the tenant's chain limit (`max_chains_per_tenant`): a conversation is a chain"}))
    async def create_conversation(self, state: State, tenant: Tenant,
                                  data: JSONBody[ConversationCreate | None] = None) -> ConversationObject:
        return await conversations_service(state).create(data or ConversationCreate(), tenant)

    @get("/{conversation_id:str}", responses=openai_errors(404, descriptions={404: _UNKNOWN}))
    async def retrieve_conversation(self, conversation_id: FromPath[str], state: State,
                                    tenant: Tenant) -> ConversationObject:
        return await conversations_service(state).get(conversation_id, tenant)

    @post("/{conversation_id:str}", status_code=200, opt={REQUEST_EXAMPLES: {"metadata": {"metadata": {"topic": "x"}}}},
          responses=openai_errors(404, descriptions={404: _UNKNOWN}))
    async def update_conversation(self, conversation_id: FromPath[str], data: JSONBody[ConversationUpdate],
                                  state: State, tenant: Tenant) -> ConversationObject:
        return await conversations_service(state).update(conversation_id, data, tenant)

    @delete("/{conversation_id:str}", status_code=200, responses=openai_errors(404, 409, descriptions={
        404: _UNKNOWN, 409: "The conversation's chain has a turn in flight"}))
    async def delete_conversation(self, conversation_id: FromPath[str], state: State,
                                  tenant: Tenant) -> ConversationDeleted:
        await conversations_service(state).delete(conversation_id, tenant)
        return ConversationDeleted(id=conversation_id)

    @get("/{conversation_id:str}/items", responses=openai_errors(404, descriptions={404: _UNKNOWN}))
    async def list_conversation_items(self, conversation_id: FromPath[str], state: State, tenant: Tenant,
                                      limit: Annotated[int, QueryParameter(ge=1, le=100)] = 20,
                                      order: FromQuery[Literal["asc", "desc"]] = "desc",
                                      after: FromQuery[str | None] = None,
                                      include: Include = None) -> ConversationItemList:
        return await conversations_service(state).list_items(conversation_id, tenant, limit, order, after)

    @post("/{conversation_id:str}/items", status_code=200,
          opt={REQUEST_EXAMPLES: {"a user message": {"items": [_HELLO]}}},
          responses=openai_errors(404, descriptions={404: _UNKNOWN}))
    async def create_conversation_items(self, conversation_id: FromPath[str], data: JSONBody[ItemsCreate],
                                        state: State, tenant: Tenant,
                                        include: Include = None) -> ConversationItemList:
        return await conversations_service(state).add_items(conversation_id, data.items, tenant)

    @get("/{conversation_id:str}/items/{item_id:str}", responses=openai_errors(404, descriptions={404: _ITEM}))
    async def retrieve_conversation_item(self, conversation_id: FromPath[str], item_id: FromPath[str], state: State,
                                         tenant: Tenant, include: Include = None) -> dict[str, Any]:
        return await conversations_service(state).get_item(conversation_id, item_id, tenant)

    @delete("/{conversation_id:str}/items/{item_id:str}", status_code=200,
            responses=openai_errors(404, 409, descriptions={
                404: _ITEM, 409: "The item is taken by the conversation's turn in flight"}))
    async def delete_conversation_item(self, conversation_id: FromPath[str], item_id: FromPath[str], state: State,
                                       tenant: Tenant) -> ConversationObject:
        return await conversations_service(state).delete_item(conversation_id, item_id, tenant)
