from agentrt_kernels.torch_ref.decode_logits import paged_decode_logits
from agentrt_kernels.torch_ref.paged_attention import paged_attention
from agentrt_kernels.torch_ref.quest import page_key_bounds, quest_page_scores
from agentrt_kernels.torch_ref.selected_slots import selected_slots_attention

__all__ = ["page_key_bounds", "paged_decode_logits", "paged_attention", "quest_page_scores", "selected_slots_attention"]
