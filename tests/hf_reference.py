"""HF transformers as the independent oracle: greedy generate and token logprobs, one prompt at a time."""

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int]) -> list[int]:
    model = hf_model(str(model_dir))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=eos_ids, pad_token_id=eos_ids[0], attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
    return out[0, len(prompt_ids):].tolist()


def hf_token_logprobs(model_dir, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    model = hf_model(str(model_dir))
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    n = len(prompt_ids)
    return [logp[n - 1 + i, t].item() for i, t in enumerate(output_ids)]
