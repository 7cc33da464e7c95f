from kernels.torch_ref.paged_attention import paged_attention

__all__ = ["paged_attention"]
