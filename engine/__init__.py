"""agentrt's inference engine: paged KV, continuous batching and the lifecycle contract for sparse methods.

Public names load lazily so that light modules (the page pool, the contract) import without the model stack.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
    "embedded_model_dir": "engine.tiny_checkpoint",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
