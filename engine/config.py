"""Engine configuration: one validated dataclass; every knob has a default that works on a laptop CPU."""

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from engine.errors import ConfigError
from engine.latent_expansion import MLA_PREFILL_MODES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("safetensors", "dummy")
DEFAULT_CPU_KV_BYTES = 512 * 2**20


@dataclass(slots=True)
class EngineConfig:
    model: str | Path
    dtype: str = "auto"  # auto: the checkpoint's dtype
    load_format: str = "safetensors"  # "dummy": seeded random weights (benchmarks of named shapes)
    device: str = "auto"  # auto: cuda when available, else cpu
    page_size: int = 16
    num_pages: int | None = None  # explicit pool size; overrides the memory budget
    kv_cache_memory_bytes: int | None = None  # byte budget for KV (CPU default 512 MiB)
    gpu_memory_utilization: float = 0.90  # fraction of GPU memory the engine may use in total
    max_num_batched_tokens: int = 2048  # token budget of one step (the prefill chunk bound)
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    method: str = "dense"
    method_config: dict[str, Any] = field(default_factory=dict)
    max_methods: int = 8  # distinct (method, config) pairs served at once, the configured one included
    kv_storage: str | None = None  # how each kept token is stored (a registered codec); None: the model dtype
    kv_storage_config: dict[str, Any] = field(default_factory=dict)
    attention_backend: str = "auto"
    enforce_eager: bool = False  # GPU: never use decode CUDA graphs
    cuda_graph_max_batch: int | None = None  # largest captured decode batch (default: max_num_seqs)
    # decode steps run back to back on the device per schedule when every request of a step decodes and its
    # method allows it (DecodeCapabilities.window): tokens reach the host once per window (1: every step)
    decode_steps: int = 1
    # launch the next window of decode steps (or the next decode step) before reading this one's tokens, so that
    # the host's work between them overlaps the device's (a request that stops in one has the next computed and
    # dropped); None: on a GPU at one rank (engine.decode_window)
    overlap_decode: bool | None = None
    # decode steps of at most 32 tokens run each RMSNorm inside the projection after it and SiLU-and-mul inside
    # the down projection, each projection at its tuned launch or through cuBLAS where that measured faster
    # (agentrt_kernels.triton.decode_linear: a GPU, or TRITON_INTERPRET=1 on the CPU); None: on a GPU at one rank
    # for the architectures that have the fused path
    fused_decode_linears: bool | None = None
    # one untimed prefill of a full step's tokens when the engine starts (engine.warmup), so that the first
    # request does not pay the kernels' compilation and autotuning; None: on a GPU at one rank
    warmup: bool | None = None
    tensor_parallel_size: int = 1  # ranks (GPUs; gloo processes on CPU) the model and its KV heads split over
    # idle chains under memory pressure move to host memory (this many bytes; 0: off, they are recomputed), a
    # full host tier moves its oldest to disk (chain_disk_dir, at most chain_disk_bytes), and a chain's next turn
    # loads its KV back (engine.chain_tiers)
    chain_host_bytes: int = 0
    chain_disk_dir: str | Path | None = None
    chain_disk_bytes: int | None = None
    # a chain's pages copied to host memory when its turn ends (a side stream), so that reclaiming it later frees
    # its pages without a copy on the step's path (engine.host_copies); off by default: docs/configuration.md
    chain_host_copies: bool = False
    # a turn's chain loaded back from the host tier on a side stream while other requests' steps run, the turn
    # admitted once its copy is done (engine.async_loads); off by default: not yet measured on a GPU
    chain_async_loads: bool = False
    # hybrid models (recurrent layers): prefill chunks end on page boundaries and the recurrent state there is kept
    # (host memory, least recently used dropped) for this many prefixes, so a request sharing a prefix resumes at
    # its last kept boundary; 0: no prefix caching for hybrid models (their state exists only at a table's end)
    prefix_checkpoints: int = 32
    # latent (MLA) models: prompt chunks over the latent rows absorbed, or over keys and values expanded per head
    # ("auto": expanded on a GPU for chunks long enough to pay for it; engine.latent_expansion)
    mla_prefill: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError as exc:
                raise ConfigError(f"device {self.device!r} is not a torch device") from exc
        positive = ["page_size", "max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size", "max_methods",
                    "decode_steps"]
        positive += [n for n in ("num_pages", "kv_cache_memory_bytes", "max_model_len", "cuda_graph_max_batch") if getattr(self, n) is not None]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.mla_prefill not in MLA_PREFILL_MODES:
            raise ConfigError(f"mla_prefill must be one of {MLA_PREFILL_MODES}, got {self.mla_prefill!r}")
        for name in ("chain_host_copies", "chain_async_loads"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.overlap_decode is not None and not isinstance(self.overlap_decode, bool):
            raise ConfigError(f"overlap_decode must be true, false or None, got {self.overlap_decode!r}")
        if self.overlap_decode and self.tensor_parallel_size > 1:
            raise ConfigError("overlap_decode needs tensor_parallel_size 1 (the ranks agree on tokens as they read "
                              "them, which overlapping would delay)")
        if self.fused_decode_linears is not None and not isinstance(self.fused_decode_linears, bool):
            raise ConfigError(f"fused_decode_linears must be true, false or None, got {self.fused_decode_linears!r}")
        if self.warmup is not None and not isinstance(self.warmup, bool):
            raise ConfigError(f"warmup must be true, false or None, got {self.warmup!r}")
        if self.warmup and self.tensor_parallel_size > 1:
            raise ConfigError("warmup needs tensor_parallel_size 1 (it runs before the ranks serve requests)")
        if self.fused_decode_linears and self.tensor_parallel_size > 1:
            raise ConfigError("fused_decode_linears needs tensor_parallel_size 1 (its kernels take whole weights)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not isinstance(self.method_config, dict):
            raise ConfigError(f"method_config must be a dict, got {type(self.method_config).__name__}")
        if self.kv_storage is not None and not isinstance(self.kv_storage, str):
            raise ConfigError(f"kv_storage must be a name or None, got {self.kv_storage!r}")
        if not isinstance(self.kv_storage_config, dict):
            raise ConfigError(f"kv_storage_config must be a dict, got {type(self.kv_storage_config).__name__}")
        for name in ("chain_host_bytes", "chain_disk_bytes", "prefix_checkpoints"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
        if (self.chain_disk_dir is None) != (self.chain_disk_bytes is None):
            raise ConfigError("chain_disk_dir and chain_disk_bytes go together (the disk tier's directory and size)")
        if self.chain_host_bytes and self.tensor_parallel_size > 1:
            raise ConfigError("chain tiers (chain_host_bytes) run at tensor_parallel_size 1 (each rank would move "
                              "its own heads' share; not built)")
        if self.chain_disk_dir is not None and not self.chain_host_bytes:
            raise ConfigError("the disk tier takes chains from the host tier: set chain_host_bytes too")
        if self.kv_storage is None and self.kv_storage_config:
            raise ConfigError("kv_storage_config is set but kv_storage is not")

    @classmethod
    def from_kwargs(cls, model: str | Path, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; known: {sorted(known - {'model'})}")
        return cls(model=model, **kwargs)

    def resolved_fused_decode_linears(self, device: torch.device, world_size: int) -> bool:
        if self.fused_decode_linears is not None:
            return self.fused_decode_linears
        return device.type == "cuda" and world_size == 1

    def resolved_warmup(self, device: torch.device, world_size: int) -> bool:
        if self.warmup is not None:
            return self.warmup
        return device.type == "cuda" and world_size == 1

    def resolved_overlap_decode(self, device: torch.device, world_size: int) -> bool:
        if self.overlap_decode is not None:
            return self.overlap_decode
        return device.type == "cuda" and world_size == 1

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
