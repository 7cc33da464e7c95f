"""An engine's parts, built from its ``EngineConfig``: ``LLMEngine`` takes each as an attribute of the same name.

The order is the order the parts depend on each other and that the checks must fail in: a method's or a KV
storage's bad knobs before the other tensor-parallel ranks start and the model loads, the cache spec before the
pool is sized (every rank agreeing on the smallest pool, so that every rank's scheduler makes the same
decisions), the cache before the backend, the methods and the chains, and chains an earlier process wrote to
disk adopted before the first request can name them.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from pathlib import Path
from typing import Any

import torch

from engine.attention_backend import AttentionBackend, make_backend
from engine.chain_manager import ChainManager
from engine.chain_tiers import ChainTiers
from engine.config import DTYPES, EngineConfig
from engine.contract.cache import CacheManager
from engine.contract.codec import KVCodec, check_composes
from engine.contract.method import SparseMethod
from engine.decode_speedups import fuse_decode_linears, reasons_against_graphs
from engine.decode_window import DecodeWindows
from engine.detokenizer import decoder_for
from engine.errors import CheckpointError, ConfigError
from engine.kv_pool_sizing import kv_pool_pages
from engine.loader import load_model
from engine.method_set import MethodSet, take_on
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.page_pool import PagePool
from engine.paged_cache import PagedCacheManager
from engine.parallel.state import TPGroup
from engine.parallel.workers import Local
from engine.parallel.workers import start as start_tensor_parallel
from engine.probe import Prober
from engine.registry import create_kv_storage, create_method
from engine.request import Request
from engine.request_checks import RequestChecks
from engine.scheduler import Scheduler
from engine.storage import coded_cache_spec, model_cache_spec

log = logging.getLogger(__name__)


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many types for a bad tokenizer dir
        raise CheckpointError(f"cannot load the tokenizer from {model_dir}: {exc}") from exc


@dataclasses.dataclass
class EngineParts:
    device: torch.device
    method: SparseMethod
    codec: KVCodec | None
    tp: TPGroup
    tp_link: Local  # the other tensor-parallel ranks (``LLMEngine._tp_link``)
    close: weakref.finalize  # stops them (``LLMEngine._close``)
    model: torch.nn.Module
    model_config: ModelConfig
    tokenizer: Any
    max_model_len: int
    pool: PagePool
    cache: CacheManager
    backend: AttentionBackend
    methods: MethodSet
    chains: ChainManager
    scheduler: Scheduler
    runner: ModelRunner
    checks: RequestChecks
    output_processor: OutputProcessor
    windows: DecodeWindows


def wire_engine(config: EngineConfig, owner: object, worker=None) -> EngineParts:
    """The parts of the engine ``owner`` for ``config``, built and ready (every rank built too).

    ``owner``: the engine being built; the other tensor-parallel ranks are stopped when it is collected (also
    when its build fails part way) or at exit. ``worker``: (group, link) when built as a tensor-parallel rank > 0
    (engine.parallel.workers)."""
    device = config.resolved_device()
    method = create_method(config.method, config.method_config)  # bad knobs fail before the load
    codec = None
    if config.kv_storage is not None:
        codec = create_kv_storage(config.kv_storage, config.kv_storage_config)
        check_composes(codec, method.name, method.view_types)
    tp, tp_link, device = start_tensor_parallel(config, device, worker)
    close = weakref.finalize(owner, tp_link.close)
    dtype = None if config.dtype == "auto" else DTYPES[config.dtype]
    model, mc = load_model(config.model, dtype=dtype, device=device, load_format=config.load_format, tp=tp)
    if mc.mla is not None and tp.world_size > 1:  # the ranks share the latent row, split its query heads
        tp = dataclasses.replace(tp, kv_heads_shared=True)
    if config.resolved_fused_decode_linears(device, tp.world_size):
        fuse_decode_linears(model, mc.architecture, device, asked=config.fused_decode_linears is True)
    tokenizer = load_tokenizer(config.model)
    max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    spec = model_cache_spec(mc, tp.world_size, next(model.parameters()).dtype, device,
                            config.page_size, config.max_num_seqs, config.prefix_checkpoints)
    if codec is not None:  # the model's KV in the codec's coded form (refused before the codec binds)
        coded = coded_cache_spec(spec, codec, config.max_num_seqs)
        if coded is None:
            raise ConfigError(f"kv_storage {codec.name!r} codes dense keys and values or latent rows; "
                              f"{mc.architecture} caches {type(spec).__name__} rows")
        spec = coded
        codec.bind_model(model)
    num_pages = kv_pool_pages(config, spec, device)
    if config.num_pages is None:
        num_pages = tp_link.agree_min(num_pages)  # every rank's pool the same size: the same schedule
    pool = PagePool(num_pages)
    method.validate(spec)
    prefix_caching = config.enable_prefix_caching and spec.prefix_reusable
    if config.enable_prefix_caching and not prefix_caching:
        log.info("prefix caching off: %s keeps per-request recurrent state that published pages do not hold "
                 "(prefix_checkpoints 0)", mc.architecture)
    cache = (method.make_cache(spec, pool, prefix_caching)
             or PagedCacheManager(spec, pool, enable_prefix_caching=prefix_caching))
    if codec is not None and cache.storage.codec is not codec:
        raise ConfigError(f"method {method.name!r} builds a cache that does not store through "
                          f"kv_storage {codec.name!r}")
    method.bind(cache)
    backend = make_backend(config.attention_backend, device, method, spec.dtype, codec, spec.head_dim,
                           spec.v_head_dim)
    methods = MethodSet(method, lambda m: take_on(m, codec, backend, spec, cache), config.max_methods)
    tiers = None
    if config.chain_host_bytes:
        tiers = ChainTiers(cache, config.chain_host_bytes, config.chain_disk_dir, config.chain_disk_bytes,
                           config.chain_host_copies)
    chains = ChainManager(cache, spec.num_layers, tiers)
    chains.async_loads = config.chain_async_loads
    if tiers is not None and tiers.disk_dir is not None:  # chains an earlier process wrote at its shutdown
        adopted = chains.memory.restore(methods.resolve)
        if adopted:
            log.info("adopted %d chain(s) from %s: their next turns load their KV", adopted, tiers.disk_dir)

    def on_preempt(req: Request) -> None:
        req.method.release(req)
        chains.on_preempt(req)

    scheduler = Scheduler(cache, config.max_num_batched_tokens, config.max_num_seqs, on_preempt=on_preempt,
                          reclaim=chains.memory.reclaim, park=chains.memory.park, unpark=chains.unpark)
    # the prefill rate a turn weighs against reading its chain from disk (engine.tier_cost)
    scheduler.step_observers.append(chains.memory.observe_prefill)
    runner = ModelRunner(model, cache, method, backend, mc.head_dim**-0.5, device)
    runner.mla_prefill = config.mla_prefill
    runner.prober = chains.prober = Prober(
        model, cache, mc.head_dim**-0.5, lambda text: tokenizer.encode(text, add_special_tokens=False), backend)
    reasons = reasons_against_graphs(config, device, backend, method, tp.world_size, model, mc.architecture)
    if reasons:
        log.info("decode CUDA graphs off: %s", "; ".join(reasons))
    else:
        runner.capture_decode_graphs(config.cuda_graph_max_batch or config.max_num_seqs,
                                     -(-max_model_len // config.page_size))
    checks = RequestChecks(tokenizer, mc.vocab_size, max_model_len, config.page_size, config.max_num_batched_tokens,
                           pool)
    output_processor = OutputProcessor(tokenizer, decoder_for(tokenizer), scheduler, chains, methods)
    overlap = config.resolved_overlap_decode(device, tp.world_size)
    windows = DecodeWindows(config, scheduler, cache, runner, output_processor, tp, device, overlap)
    tp_link.wait_ready()
    return EngineParts(device, method, codec, tp, tp_link, close, model, mc, tokenizer, max_model_len, pool, cache,
                       backend, methods, chains, scheduler, runner, checks, output_processor, windows)
