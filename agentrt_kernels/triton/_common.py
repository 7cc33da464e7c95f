"""Helpers shared by the Triton kernels: interpreter detection, dot precision, device facts.

Under ``TRITON_INTERPRET=1`` kernels run on the CPU through numpy, which mishandles bf16 arithmetic and
bf16 ``tl.dot``; kernels therefore do all elementwise math in fp32 and take an ``UPCAST`` constexpr that
feeds ``tl.dot`` fp32 operands when interpreting bf16. On a GPU the dots run on native fp16/bf16
operands (fp32 accumulation), and fp32 inputs use IEEE fp32 dots (no tf32) so fp32 models stay exact.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda


def _fix_interpreter_scalar_index() -> None:
    """Let interpreted kernels use loaded scalars as loop bounds (``range(start, end, BLOCK)``).

    Triton 3.6's interpreter holds every scalar as a shape-[1] numpy array and converts it with
    ``int(array)``, which NumPy >= 2.4 rejects. Wrap its tensor patch so ``__index__`` goes through
    ``.item()``. Only touches the CPU interpreter; compiled GPU kernels are unaffected.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_agentrt_wrapped", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._agentrt_wrapped = True
    interpreter._patch_lang_tensor = patched


def _interpret_stdlib_functions() -> None:
    """Make triton.language's own @jit functions (tl.sum, tl.max, tl.cdiv, tl.zeros, ...) interpretable.

    They are decorated once, when triton is first imported. If that import happened before
    TRITON_INTERPRET=1 was set (say another library imported triton earlier in the same process), they are
    compiled-only JITFunctions and an interpreted kernel calling them fails with "Cannot call @triton.jit'd
    outside of the scope of a kernel". In interpret mode, swap each for the InterpretedFunction that
    ``@triton.jit`` would have produced (the interpreter's numpy fast paths for sum/max/min match on these
    very objects). Does nothing outside interpret mode, or when they are interpretable already.
    """
    try:
        from triton import knobs
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover
        return
    if not knobs.runtime.interpret:
        return
    import triton.language.core as tl_core
    import triton.language.standard as tl_standard

    converted: dict[int, InterpretedFunction] = {}

    def convert(obj):
        if id(obj) not in converted:
            converted[id(obj)] = InterpretedFunction(obj.fn)
        return converted[id(obj)]

    for module in (tl_standard, tl, tl.math):
        for name, obj in list(vars(module).items()):
            if isinstance(obj, JITFunction):
                setattr(module, name, convert(obj))
    # tensor member forms (x.sum(), x.to(), ...) are wrappers closing over the function
    for name, attr in list(vars(tl_core.tensor).items()):
        cells = getattr(attr, "__closure__", None) or ()
        targets = [c.cell_contents for c in cells if isinstance(c.cell_contents, JITFunction)]
        if len(targets) == 1:
            new = convert(targets[0])

            def member(*args, _fn=new, **kwargs):
                return _fn(*args, **kwargs)

            member.__name__ = name
            setattr(tl_core.tensor, name, member)


_fix_interpreter_scalar_index()
_interpret_stdlib_functions()


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` (a ``@triton.jit`` function) runs in the CPU interpreter."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return False
    return isinstance(kernel, InterpretedFunction)


def dot_args(kernel, dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST, input precision) constexprs for a kernel whose tl.dot operands have ``dtype``."""
    upcast = is_interpreted(kernel) and dtype == torch.bfloat16
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return upcast, precision


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132 on an H100/H200 SXM when not on a GPU)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 132


PDL_ENV = "AGENTRT_PDL"


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch (PDL: Hopper and later, unless
    ``AGENTRT_PDL=0``). A decode step is a chain of small launches; under PDL a kernel's programs are placed on
    the SMs while its predecessor runs and wait there (``pdl_enter``) instead of being launched after it ends,
    which hides the launch gap between dependent kernels, in CUDA graphs too."""
    if device.type != "cuda" or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return _pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first statement where it may be launched with ``launch_pdl``: wait until the previous kernel
    in the stream has finished and its writes are visible (before this kernel reads or writes anything), then
    let the next kernel's programs be placed. Waiting first keeps at most one kernel ahead of the running one;
    without PDL both instructions do nothing, and the interpreter never sees them."""
    if PDL:
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()


# (device, stream) -> arrival counters of launches whose last program to arrive finishes a tile (the split decode
# linears, the experts' down GEMM adding each token's choices, paged decode attention merging its splits): zeros
# between launches (that last program resets its tile's). Every buffer ever handed out stays referenced: a
# captured CUDA graph keeps its address.
_COUNTERS: dict[tuple, list[torch.Tensor]] = {}


def arrival_counts(device: torch.device, tiles: int) -> torch.Tensor:
    """At least ``tiles`` int32 zeros for such a launch on the current stream of ``device``. Launches on one
    stream run one after another (under programmatic dependent launch each waits for its predecessor before its
    first load), so they share a buffer; another stream gets its own."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    held = _COUNTERS.setdefault((device, stream), [])
    if not held or held[-1].numel() < tiles:
        held.append(torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device))
    return held[-1]


@triton.jit
def last_to_arrive(count_ptr, arrivals):
    """Whether this program is the last of ``arrivals`` to arrive on the counter at ``count_ptr`` (an
    ``arrival_counts`` slot): after a barrier (every thread's stores before the release), one acquire-release
    increment. The last one sees every other program's stores; it resets the counter when done with it."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == arrivals - 1


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)})")


def head_tile(head_dim: int) -> int:
    """Channels of q and k one dot takes: the whole (power-of-two padded) head up to 256; wider heads (MLA's
    512 + 64 latent) in 64-channel slices, since a [BLOCK_N, 1024] key tile and its query rows need more
    shared memory than an H100 / H200 block has (227 KiB)."""
    return max(16, next_pow2(head_dim)) if head_dim <= 256 else 64
