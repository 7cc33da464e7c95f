"""Kept for importers written before ``agentrt_kernels.ops``, which is the CPU/GPU switch: the same functions."""

from agentrt_kernels.ops import paged_decode_logits, quest_page_scores, window_votes

__all__ = ["paged_decode_logits", "quest_page_scores", "window_votes"]
