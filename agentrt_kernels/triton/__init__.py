"""Triton GPU kernels for the engine's hot paths (plain functions over tensors; never imports engine/).

Each module's docstring gives shapes, dtypes and the kernel design. Importing this package needs
``triton``; with ``TRITON_INTERPRET=1`` (set before the import) the kernels run on the CPU interpreter.
"""

from agentrt_kernels.triton.activation import silu_and_mul
from agentrt_kernels.triton.decode_attention import choose_num_splits, paged_decode_attention, two_wave_splits
from agentrt_kernels.triton.decode_logits import paged_decode_logits
from agentrt_kernels.triton.kv_store import store_kv
from agentrt_kernels.triton.moe import fused_moe, moe_align_block_size
from agentrt_kernels.triton.grouped_router import route_grouped_sigmoid
from agentrt_kernels.triton.moe_router import route_topk
from agentrt_kernels.triton.norm import rms_norm
from agentrt_kernels.triton.prefill_attention import paged_prefill_attention
from agentrt_kernels.triton.quest import quest_decode_scores, quest_decode_table, quest_page_scores
from agentrt_kernels.triton.rotary import apply_rotary, rotary_and_store

__all__ = [
    "apply_rotary",
    "choose_num_splits",
    "fused_moe",
    "moe_align_block_size",
    "paged_decode_attention",
    "paged_decode_logits",
    "paged_prefill_attention",
    "quest_decode_scores",
    "quest_decode_table",
    "quest_page_scores",
    "rms_norm",
    "rotary_and_store",
    "route_grouped_sigmoid",
    "route_topk",
    "silu_and_mul",
    "store_kv",
    "two_wave_splits",
]
