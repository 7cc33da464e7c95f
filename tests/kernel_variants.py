"""What a Triton launch would compile: the kernel's constexpr values and the argument properties Triton
specializes a compiled kernel on (an int equal to 1 or divisible by 16, a tensor's dtype and 16-byte
alignment). Recorded from the launches of Triton's CPU interpreter, which compiles nothing: a data-dependent
constexpr (a tile count, a length) means a kernel compiled at every new value on a GPU, seconds of compilation
spread over a server's life."""

from __future__ import annotations

import collections
import contextlib
import inspect
from collections.abc import Iterator

import torch


def _spec(value) -> tuple:
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value == 1, value % 16 == 0, -2**31 <= value < 2**31)
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.data_ptr() % 16 == 0)
    return (type(value).__name__,)


class Launches:
    """Per kernel name, the constexpr values of each launch (``constexprs``) and its full specialization key."""

    def __init__(self) -> None:
        self.constexprs: dict[str, set[tuple]] = collections.defaultdict(set)
        self.keys: dict[str, set[tuple]] = collections.defaultdict(set)

    def record(self, fn, args: tuple, kwargs: dict) -> None:
        import triton.language as tl

        sig = inspect.signature(fn)
        bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
        consts, key = [], []
        for name, param in sig.parameters.items():
            if name not in bound.arguments:
                continue
            value = bound.arguments[name]
            if param.annotation is tl.constexpr or "constexpr" in str(param.annotation):
                consts.append((name, repr(value)))
            else:
                key.append((name, _spec(value)))
        launch = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in sig.parameters))
        self.constexprs[fn.__name__].add(tuple(consts) + launch)
        self.keys[fn.__name__].add(tuple(consts) + tuple(key) + launch)


@contextlib.contextmanager
def recorded_launches() -> Iterator[Launches]:
    """Every Triton launch inside the block (Triton's interpreter: ``TRITON_INTERPRET=1`` before the kernels'
    modules are imported), recorded into the ``Launches`` it yields."""
    from triton.runtime.interpreter import InterpretedFunction

    launches, original = Launches(), InterpretedFunction.run

    def run(self, *args, grid=None, warmup=False, **kwargs):
        launches.record(self.fn, args, kwargs)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield launches
    finally:
        InterpretedFunction.run = original
