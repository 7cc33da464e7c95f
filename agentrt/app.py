"""The Litestar application: ``create_app(config)``; the lifespan owns the engine worker and the database."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide
from litestar.logging import LoggingConfig
from litestar.types import Scope

from agentrt.auth import TENANT_SCOPE_KEY, KeyService, WebSocketDenial, auth_guard
from agentrt.chains import ChainService
from agentrt.chat import ChatRenderer
from agentrt.completions import CompletionService
from agentrt.config import ServerConfig, default_db_url
from agentrt.db import open_database
from agentrt.engine_worker import EngineWorker
from agentrt.errors import EXCEPTION_HANDLERS
from agentrt.metrics import Metrics
from agentrt.openapi import openapi_config
from agentrt.render_pool import RenderPool
from agentrt.request_guards import strict_json_body
from agentrt.host_guard import host_guard
from agentrt.routes import ChainController, OpenAIController, SystemController
from agentrt.routes.anthropic import AnthropicController
from agentrt.routes.conversations import ConversationsController
from agentrt.routes.openai import TextCompletionsController
from agentrt.routes.responses import ResponsesController
from agentrt.tool_syntax import by_name

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from agentrt.db import Database
    from agentrt.scaleout.leases import ChainLeases
    from engine.engine_handle import EngineHandle

    RemoteFactory = Callable[[Database], Awaitable[tuple[Any, ChainLeases]]]

log = logging.getLogger(__name__)


def build_engine(config: ServerConfig) -> EngineHandle:
    from agentrt.native_memory import bound_native_caches
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from agentrt.config import embedded_model_dir

    bound_native_caches()  # before the model's first matmul: a server's step shapes would fill oneDNN's caches
    model = config.model if config.model is not None else embedded_model_dir()
    options = {"method": config.method, "method_config": config.method_config, **config.engine_options}
    return LLMEngine(EngineConfig.from_kwargs(model, **options))


def _chains(state: State) -> ChainService:
    return state.chains


def _completions(state: State) -> CompletionService:
    return state.completions


def _tenant(scope: Scope) -> str:
    return scope[TENANT_SCOPE_KEY]  # type: ignore[literal-required]  # set by auth_guard


GIL_SWITCH_INTERVAL_S = 0.0005


def create_app(config: ServerConfig | None = None, engine: EngineHandle | None = None,
               remote: RemoteFactory | None = None) -> Litestar:
    """``engine``: an LLMEngine to serve instead of building one from ``config`` (it is not closed on exit).
    ``remote``: serve engine replicas elsewhere instead (agentrt.scaleout): called with the database, it returns
    the started worker (EngineWorker's interface) and the chain leases the HTTP replicas share.
    Raises agentrt.config.ConfigurationError for a configuration that must not serve (e.g. no auth off
    loopback)."""
    config = config or ServerConfig()
    config.check()
    # The engine thread runs thousands of short torch calls a step, each giving up and taking back the GIL; while a
    # render thread runs pure-Python templating (a huge turn: seconds), each take-back waits out the switch interval
    # (5 ms by default), so a step of another client's turn slowed to seconds. 0.5 ms bounds that wait.
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        db = await open_database(config.db_url or default_db_url())
        leases = None
        if remote is not None:
            worker, leases = await remote(db)
            llm = worker.engine
        else:
            llm = engine if engine is not None else await anyio.to_thread.run_sync(build_engine, config)
            worker = EngineWorker(llm, max_queue_depth=config.max_queue_depth, retry_after_s=config.retry_after_s)
        from engine.llm_engine import load_tokenizer
        from engine.tiny_checkpoint import DEFAULT_MODEL_NAME

        model_dir = Path(llm.config.model)
        model_name = config.model_name or (DEFAULT_MODEL_NAME if config.model is None else model_dir.name)
        syntax = by_name(config.tool_call_syntax) if config.tool_call_syntax else None
        renderer = ChatRenderer(load_tokenizer(model_dir), llm.model_config.eos_token_ids, syntax)
        log.info("tool calls in the %s syntax", renderer.tool_syntax.name)
        pool = RenderPool(renderer, llm.max_model_len, config.render_workers, config.max_chars_per_token)
        chains = ChainService(config, model_name, worker, pool, db, leases=leases)
        await chains.start()
        metrics = Metrics(worker, chains.counts)
        chains.metrics = metrics
        if remote is None:
            worker.on_step = metrics.observe_step
            worker.start()
        else:
            from agentrt.scaleout.replica_metrics import register_replica_gauges

            register_replica_gauges(metrics.registry, worker)
        keys = KeyService(db)
        if config.auth_required and not await keys.count_active():
            log.warning("auth is required but the database holds no active API key: create one with "
                        "`agentrt keys create --tenant NAME --db URL`")
        app.state.update(config=config, model_name=model_name, started_at=int(time.time()), worker=worker, db=db,
                         api_keys=keys,
                         chains=chains, metrics=metrics,
                         completions=CompletionService(config, model_name, worker, pool, metrics, chains))
        log.info("serving %s (method %s) with %s; auth %s", model_name, llm.method.name,
                 db.engine.url.render_as_string(), "required" if config.auth_required else "off (loopback)")
        try:
            yield
        finally:
            worker.stop()
            await db.dispose()

    return Litestar(
        route_handlers=[ChainController, OpenAIController, TextCompletionsController, ResponsesController,
                        ConversationsController, SystemController, AnthropicController],
        dependencies={"chains": Provide(_chains, sync_to_thread=False),
                      "completions": Provide(_completions, sync_to_thread=False),
                      "tenant": Provide(_tenant, sync_to_thread=False)},
        guards=[auth_guard] if (hosts := config.host_allow_list) is None else [host_guard(hosts), auth_guard],
        before_request=strict_json_body,
        # a refused WebSocket handshake is answered with its HTTP status (401, 400) and error body, not a bare 403
        middleware=[WebSocketDenial()],
        after_exception=[WebSocketDenial.record],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[lifespan],
        request_max_body_size=config.max_body_size,
        logging_config=LoggingConfig(configure_root_logger=False, log_exceptions="debug"),
        openapi_config=openapi_config(config),
    )
