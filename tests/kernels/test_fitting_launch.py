"""``agentrt_kernels.triton.fitting_launch``: a launch past the GPU's shared memory steps down to one that fits."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton.runtime.errors import OutOfResources  # noqa: E402

from agentrt_kernels.triton import fitting_launch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_a_launch_past_the_gpus_shared_memory_steps_down_and_is_remembered():
    """``launch_fitting`` on a GPU whose shared memory a block holds fewer stages than the default launch (an
    A100, an L40S): Triton's ``OutOfResources`` for shared memory, raised before the launch, steps down to two
    stages, then to halved tiles, runs the first that fits and goes straight to it on the next call; other
    refusals (registers) and a launch that nothing fits raise as they were."""
    def gpu(limit_bytes):
        calls = []

        def launch(block_n, stages):  # ~18 KB a stage of 16 latent rows (576 bf16 channels a row)
            calls.append((block_n, stages))
            if block_n * 576 * 2 * stages > limit_bytes:
                raise OutOfResources(block_n * 576 * 2 * stages, limit_bytes, "shared memory")
        return launch, calls

    fitting_launch._FITTED.clear()
    launch, calls = gpu(227 * 1024)  # a Hopper: the launch asked for
    assert fitting_launch.launch_fitting(launch, 0, ("k",), 64, 3) == (64, 3) and calls == [(64, 3)]
    launch, calls = gpu(163 * 1024)  # an A100: two stages of 64 rows
    assert fitting_launch.launch_fitting(launch, 1, ("k",), 64, 5) == (64, 2) and calls == [(64, 5), (64, 2)]
    calls.clear()
    assert fitting_launch.launch_fitting(launch, 1, ("k",), 64, 5) == (64, 2) and calls == [(64, 2)]
    launch, calls = gpu(99 * 1024)  # an L40S: 32 rows in two stages
    assert fitting_launch.launch_fitting(launch, 2, ("k",), 64, 5) == (32, 2)
    assert calls == [(64, 5), (64, 2), (32, 2)]
    launch, _ = gpu(16 * 1024)  # not even 16 rows in two stages
    with pytest.raises(OutOfResources):
        fitting_launch.launch_fitting(launch, 3, ("k",), 64, 5)

    register_calls = []

    def registers(block_n, stages):  # not a refusal that fewer stages or rows answer: raised at once
        register_calls.append((block_n, stages))
        raise OutOfResources(300, 255, "registers")
    with pytest.raises(OutOfResources):
        fitting_launch.launch_fitting(registers, 4, ("k",), 64, 5)
    assert register_calls == [(64, 5)]
    fitting_launch._FITTED.clear()


def test_a_launch_whose_tile_is_fixed_steps_down_in_stages_only():
    """``min_tile`` at the tile asked for (a kernel whose tile cannot shrink): two stages, and past them the
    refusal itself."""
    calls = []

    def launch(tile, stages):
        calls.append((tile, stages))
        if tile * stages > 128:
            raise OutOfResources(tile * stages, 128, "shared memory")
    fitting_launch._FITTED.clear()
    assert fitting_launch.launch_fitting(launch, 0, ("k",), 64, 3, min_tile=64) == (64, 2)
    assert calls == [(64, 3), (64, 2)]
    with pytest.raises(OutOfResources):
        fitting_launch.launch_fitting(launch, 0, ("k",), 128, 3, min_tile=128)
    fitting_launch._FITTED.clear()


class _SmallSharedMemory:
    """A Triton kernel as on a GPU with less shared memory a block than the launch asks for: its first launch is
    refused (``OutOfResources``, before it runs), later ones run the kernel."""

    def __init__(self, kernel, tile):
        self.kernel, self.tile, self.launches = kernel, tile, []

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append((kwargs[self.tile], kwargs["num_stages"]))
            if len(self.launches) == 1:
                raise OutOfResources(300 * 1024, 99 * 1024, "shared memory")
            return self.kernel[grid](*args, **kwargs)
        return run


def _mla_decode():
    from agentrt_kernels.triton import mla_decode

    g = torch.Generator().manual_seed(1)
    q, latent = torch.randn(3, 20, 48, generator=g), torch.randn(12, 16, 1, 48, generator=g)
    bt, lens = torch.arange(12, dtype=torch.int32).reshape(3, 4), torch.tensor([60, 17, 33], dtype=torch.int32)
    q, latent, bt, lens = (t.to(DEVICE) for t in (q, latent, bt, lens))
    return mla_decode, "_mla_split_kernel", "BLOCK_N", lambda: mla_decode.mla_paged_decode(q, latent, bt, lens, 0.2, 32,
                                                                               num_splits=2, num_stages=3)


def _mla_prefill():
    from agentrt_kernels.triton import mla_prefill

    g = torch.Generator().manual_seed(2)
    q, latent = torch.randn(40, 20, 48, generator=g), torch.randn(12, 16, 1, 48, generator=g)
    bt, lens = torch.arange(12, dtype=torch.int32).reshape(2, 6), torch.tensor([70, 30], dtype=torch.int32)
    qsl = torch.tensor([0, 30, 40], dtype=torch.int32)
    q, latent, bt, lens, qsl = (t.to(DEVICE) for t in (q, latent, bt, lens, qsl))
    return mla_prefill, "_mla_prefill_kernel", "BLOCK_N", lambda: mla_prefill.mla_paged_prefill(
        q, latent, bt, lens, qsl, 0.2, 32, max_query_len=30)


def _prefill():
    from agentrt_kernels.triton import prefill_attention

    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(40, 4, 16, generator=g), torch.randn(12, 16, 2, 16, generator=g), torch.randn(
        12, 16, 2, 16, generator=g)
    bt, lens = torch.arange(12, dtype=torch.int32).reshape(2, 6), torch.tensor([70, 30], dtype=torch.int32)
    qsl = torch.tensor([0, 30, 40], dtype=torch.int32)
    q, k, v, bt, lens, qsl = (t.to(DEVICE) for t in (q, k, v, bt, lens, qsl))
    return prefill_attention, "_prefill_kernel", "BLOCK_N", lambda: prefill_attention.paged_prefill_attention(
        q, k, v, bt, lens, qsl, 0.25, max_query_len=30, num_stages=3)


def _decode_linear():
    from agentrt_kernels.triton import decode_linear

    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 128, generator=g), torch.randn(96, 128, generator=g) / 128**0.5
    x, w = x.to(DEVICE), w.to(DEVICE)
    return decode_linear, "_decode_linear_kernel", "BLOCK_K", lambda: decode_linear.decode_linear(
        x, w, launch={"BLOCK_N": 32, "BLOCK_K": 64, "num_stages": 2})


@pytest.mark.parametrize("case", [_mla_decode, _mla_prefill, _prefill, _decode_linear])
def test_each_kernel_wrapper_runs_a_smaller_launch_where_its_own_is_refused(case, monkeypatch):
    """The MLA decode and prefill kernels, the paged prefill kernel and the fused decode linears, as on a GPU that
    refuses their launch for shared memory: the next smaller launch runs (two stages, or a halved tile where the
    launch has two already), and its output is the one the launch asked for gives where that fits."""
    module, name, tile_name, call = case()
    fitting_launch._FITTED.clear()
    want = call()
    fitting_launch._FITTED.clear()
    proxy = _SmallSharedMemory(getattr(module, name), tile_name)
    monkeypatch.setattr(module, name, proxy)
    got = call()
    fitting_launch._FITTED.clear()
    (tile, stages), (next_tile, next_stages) = proxy.launches[:2]
    assert len(proxy.launches) == 2
    assert (next_tile, next_stages) == ((tile, 2) if stages > 2 else (tile // 2, stages))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
