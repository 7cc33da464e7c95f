"""The in-place decode kernels of the gated DeltaNet (agentrt_kernels.triton.gated_delta_step) against their torch
references (gather the slots' states, the reference step, scatter back), on fresh random inputs, fp32 and bf16:
outputs, the states written at the batch's slots, and every other slot untouched. Without a GPU the kernels run
in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported) at tiny sizes."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from agentrt_kernels.torch_ref import gated_delta as ref  # noqa: E402
from agentrt_kernels.triton import gated_delta_step as kernels  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _slots(batch, num_slots, gen):
    return torch.randperm(num_slots, generator=gen)[:batch].to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel", [4, 3])
def test_conv_update_equals_the_reference_and_moves_only_the_batch_slots(dtype, kernel):
    gen = torch.Generator().manual_seed(kernel)
    batch, channels, num_slots = 3, 40, 7  # 40 channels: a partial channel block
    x = torch.randn(batch, 2 * channels, generator=gen).to(DEVICE, dtype)[:, :channels]  # a strided row, as a split
    weight = torch.randn(channels, kernel, generator=gen).to(DEVICE, dtype)
    states = torch.randn(num_slots, channels, kernel - 1, generator=gen).to(DEVICE, dtype)
    slots = _slots(batch, num_slots, gen)
    expected_states = states.clone()
    expected = ref.causal_conv1d_update(x, weight, expected_states, slots)
    got = kernels.causal_conv1d_update(x, weight, states, slots)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(states, expected_states)  # the shift moves values exactly, other slots untouched


@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)], ids=["fp32", "bf16", "bf16-state"])
def test_delta_step_equals_the_reference_and_updates_the_states_in_place(dtype, state_dtype):
    gen = torch.Generator().manual_seed(7)
    batch, nk, nv, dk, dv, num_slots = 3, 2, 4, 16, 24, 6  # GVA (2 value heads a key head); 24: a partial block
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    mixed = rand(batch, 2 * nk * dk + nv * dv)  # q | k | v as the conv's output rows: strided views
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q, k, v = q.view(batch, nk, dk), k.view(batch, nk, dk), v.view(batch, nv, dv)
    ab = rand(batch, 2 * nv, scale=3.0)  # a | b, raw; large enough that softplus and sigmoid saturate somewhere
    b, a = ab.split([nv, nv], dim=-1)
    A_log = (torch.rand(nv, generator=gen) * 2 - 1).to(DEVICE, dtype)
    dt_bias = torch.randn(nv, generator=gen).to(DEVICE, dtype)
    states = (torch.randn(num_slots, nv, dk, dv, generator=gen) * 0.5).to(DEVICE, state_dtype)
    slots = _slots(batch, num_slots, gen)
    expected_states = states.clone()
    expected = ref.gated_delta_step(q, k, v, a, b, A_log, dt_bias, expected_states, slots)
    got = kernels.gated_delta_step(q, k, v, a, b, A_log, dt_bias, states, slots)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
    tol = TOL[state_dtype] if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(states.float(), expected_states.float(), atol=tol, rtol=tol)
    others = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.equal(states[others], expected_states[others])


def test_two_steps_carry_the_state_as_the_reference_rule_over_two_tokens():
    """Two decode steps through the slot buffer equal the token-by-token rule over the two tokens at once."""
    gen = torch.Generator().manual_seed(11)
    nk, nv, dk, dv = 1, 2, 8, 8
    q, k = (torch.randn(2, 1, nk, dk, generator=gen).to(DEVICE) for _ in range(2))
    v = torch.randn(2, 1, nv, dv, generator=gen).to(DEVICE)
    a, b = (torch.randn(2, 1, nv, generator=gen).to(DEVICE) for _ in range(2))
    A_log, dt_bias = torch.zeros(nv, device=DEVICE), torch.zeros(nv, device=DEVICE)
    states = torch.zeros(2, nv, dk, dv, device=DEVICE)
    slots = torch.tensor([1], device=DEVICE)
    outs = [kernels.gated_delta_step(q[t], k[t], v[t], a[t], b[t], A_log, dt_bias, states, slots) for t in range(2)]
    g, beta = ref.gated_delta_gates(a[:, 0], b[:, 0], A_log, dt_bias)
    want, final = ref.recurrent_gated_delta_rule(q[:, 0], k[:, 0], v[:, 0], g, beta, None)
    torch.testing.assert_close(torch.stack([o[0] for o in outs]), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(states[1], final, atol=2e-5, rtol=2e-5)
    assert torch.equal(states[0], torch.zeros_like(states[0]))


_SM90_SCRIPT = """
import json, sys
import torch
from benchmarks.kernel_resources import captured_launches, compile_sm90
from agentrt_kernels.triton import gated_delta_step as m

rows = []
for nk, nv, d, conv_k, state_dtype in json.loads(sys.argv[1]):
    bf = dict(dtype=torch.bfloat16)
    b, slots = 8, torch.arange(8)
    mixed = torch.zeros(b, 2 * nk * d + nv * d, **bf)
    q, k, v = mixed.split([nk * d, nk * d, nv * d], dim=-1)
    q, k, v = q.view(b, nk, d), k.view(b, nk, d), v.view(b, nv, d)
    ab = torch.zeros(b, 2 * nv, **bf)
    states = torch.zeros(16, nv, d, d, dtype=getattr(torch, state_dtype))
    conv_states = torch.zeros(16, mixed.shape[1], conv_k - 1, **bf)
    weight = torch.zeros(mixed.shape[1], conv_k, **bf)
    calls = {
        "delta_step": lambda: m.gated_delta_step(q, k, v, ab[:, :nv], ab[:, nv:], torch.zeros(nv), torch.zeros(nv),
                                                 states, slots),
        "conv_update": lambda: m.causal_conv1d_update(mixed, weight, conv_states, slots),
    }
    for name, call in calls.items():
        with captured_launches() as launches:
            call()
        fn, args, options = launches[0]
        r = compile_sm90(fn, args, **options)
        rows.append(dict(kernel=name, state=state_dtype, **{k: r[k] for k in ("registers", "spill_stores")}))
print(json.dumps(rows))
"""


def test_the_kernels_compile_for_sm90_without_spills():
    """Qwen3.6-27B's linear layers (16 key / 48 value heads of 128, conv kernel 4; fp32 and bf16 states) as
    compiled for an H100 / H200 (Triton's bundled ptxas, no GPU needed): the state tile stays in registers."""
    from tests.kernels.sm90_compile import compiled_rows

    rows = compiled_rows(_SM90_SCRIPT, [[16, 48, 128, 4, "float32"], [16, 48, 128, 4, "bfloat16"]])
    assert len(rows) == 4
    for r in rows:
        assert r["spill_stores"] == 0, r
