"""A dense, unpaged reference: our model code (checked against HF in test_models_vs_hf) with attention
computed over the full [T, T] matrix under an explicit per-(layer, kv head) visibility mask."""

from collections.abc import Callable

import torch

# visible(layer, T) -> bool [num_kv_heads, T, T]: may query i attend to key j (causality included)
Visibility = Callable[[int, int], torch.Tensor]


class MaskedDenseRunner:
    wants_layer_output = True  # the model calls end_layer (LayerRunner)

    def __init__(self, visible: Visibility):
        self.visible = visible

    def attention(self, layer, q, k, v):
        T, hq, d = q.shape
        group = hq // k.shape[1]
        mask = self.visible(layer, T).repeat_interleave(group, dim=0)  # [Hq, T, T]
        logits = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(group, 1)) * d**-0.5
        probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v.float().repeat_interleave(group, 1)).to(q.dtype)

    def end_layer(self, layer, hidden):
        pass


class RecordingRunner:
    """Full-matrix attention under ``visible(layer, T)`` ([Hkv, T, T] bool); records the probabilities."""

    wants_layer_output = True  # the model calls end_layer (LayerRunner)

    def __init__(self, visible):
        self.visible = visible
        self.probs = {}

    def attention(self, layer, q, k, v):
        T, hq, d = q.shape
        group = hq // k.shape[1]
        mask = self.visible(layer, T).repeat_interleave(group, dim=0)
        logits = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(group, 1)) * d**-0.5
        probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
        self.probs[layer] = probs  # [Hq, T, T]
        return torch.einsum("hqk,khd->qhd", probs, v.float().repeat_interleave(group, 1)).to(q.dtype)

    def end_layer(self, layer, hidden):
        pass


class FreshLinearState:
    """A hybrid model's linear-attention state for one sequence computed from its first token: zeros before the
    pass, in buffers of their own at slot 0; what the layer writes there is dropped with them (the next pass
    starts from scratch again)."""

    def __init__(self, model, num_tokens: int):
        linear, param = model.config.linear, next(model.parameters())
        self.query_lens = [num_tokens]
        self.slots = torch.zeros(1, dtype=torch.int64)
        self.conv_buffer = torch.zeros(1, *linear.conv_state_shape, dtype=param.dtype)
        self.recurrent_buffer = torch.zeros(1, *linear.recurrent_state_shape,
                                            dtype=getattr(torch, linear.recurrent_dtype))


def from_scratch(runner, model, num_tokens: int):
    """``runner`` made ready for a whole-sequence forward of ``num_tokens`` tokens: hybrid models' linear layers
    get a fresh state (``LayerRunner.linear_state``)."""
    if getattr(model.config, "linear", None) is not None:
        runner.linear_state = lambda layer: FreshLinearState(model, num_tokens)
    return runner


def causal(num_kv_heads: int, T: int) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool).tril().expand(num_kv_heads, T, T)


@torch.no_grad()
def greedy_with_mask(model, prompt: list[int], max_new: int, visible: Visibility) -> list[int]:
    """Greedy decode recomputing the whole sequence each token under ``visible``."""
    ids = list(prompt)
    for _ in range(max_new):
        x = torch.tensor(ids)
        hidden = model(x, torch.arange(len(ids)), from_scratch(MaskedDenseRunner(visible), model, len(ids)))
        ids.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return ids[len(prompt):]


def pruned_visibility(kept, boundary):
    """Queries at or after ``boundary`` (computed after the pruning) see only the kept KV before it."""
    def visible(layer, T):
        m = causal(kept[layer].shape[0], T).clone()
        for h, positions in enumerate(kept[layer]):
            row = torch.zeros(boundary, dtype=torch.bool)
            row[positions[positions < boundary]] = True
            m[h, boundary:, :boundary] &= row
        return m
    return visible
