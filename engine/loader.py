"""Build a model from a Hugging Face checkpoint directory without instantiating any HF model.

The module is built once on the target device in the target dtype, then safetensors tensors stream into
it one at a time (converted on copy).
"""

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from engine.errors import CheckpointError, ConfigError
from engine.model_config import ModelConfig
from engine.models.registry import get_model_class
from engine.parallel.layers import check_model_shards
from engine.parallel.state import SINGLE, TPGroup, use_group

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
LOAD_FORMATS = ("safetensors", "dummy")
_INDEX_FILE = "model.safetensors.index.json"


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    load_format: str = "safetensors",
    tp: TPGroup = SINGLE,
) -> tuple[nn.Module, ModelConfig]:
    """Returns (model in eval mode with frozen parameters, its ModelConfig). dtype None = checkpoint's.

    load_format "dummy" skips the weight files and fills parameters with seeded random values (benchmarks).
    With a tensor-parallel group the model holds this rank's shard: each parameter's loader copies its
    slice out of the checkpoint tensor, so only the shard reaches ``device``.
    """
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    config = ModelConfig.from_dir(model_dir)
    target_dtype = resolve_dtype(dtype, config.torch_dtype)
    model_class = get_model_class(config.architecture)
    check_model_shards(config, tp.world_size)
    with torch.device(device), _default_dtype(target_dtype), use_group(tp):
        model = model_class(config)
    if load_format == "dummy":
        fill_dummy_weights(model)
    else:
        model.load_weights(iter_checkpoint_tensors(checkpoint_files(Path(model_dir))))
    model.eval()
    model.requires_grad_(False)
    return model, config


def resolve_dtype(dtype: torch.dtype | None, checkpoint_dtype: str) -> torch.dtype:
    if dtype is None:
        if checkpoint_dtype not in SUPPORTED_DTYPES:
            raise ConfigError(
                f"checkpoint dtype {checkpoint_dtype!r} is not supported; pass one of {', '.join(SUPPORTED_DTYPES)}"
            )
        return SUPPORTED_DTYPES[checkpoint_dtype]
    if dtype not in SUPPORTED_DTYPES.values():
        raise ConfigError(f"dtype {dtype} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}")
    return dtype


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those the index names, else model.safetensors, else all."""
    index_path = model_dir / _INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            files = [model_dir / name for name in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index_path} is not a valid safetensors index: {e}") from e
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index_path} names missing shard file(s): {', '.join(absent)}")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weight files in {model_dir}")
    return files


def iter_checkpoint_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, CPU tensor) for every tensor of every file, one tensor in memory at a time."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (OSError, SafetensorError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e


def fill_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Norm weights 1, everything else N(0, std), from a generator seeded on the parameters' device."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            generator = torch.Generator(device=param.device).manual_seed(seed)
            param.data.normal_(0.0, std, generator=generator)
            seed += 1


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
