"""One model's engine on the GPU against the same engine on the CPU (its torch references): greedy tokens equal,
logprobs within ``tol``. For the GPU-only tests of a model family's kernels."""

import torch


def assert_gpu_engine_matches_cpu(model_dir, num_pages: int, seed: int, tol: float = 2e-3) -> None:
    """fp32, four prompts of different lengths (7 to 200 tokens) prefilled in chunks of 128 beside decoding
    requests, then 12 greedy tokens each."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 500, (n,), generator=gen).tolist() for n in (7, 90, 200, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True)
    results = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model_dir, device=device, dtype="float32", max_num_batched_tokens=128, num_pages=num_pages,
                  page_size=16, enable_prefix_caching=False)
        results[device] = llm.generate(prompts, params)
        llm.close()
    for cpu, gpu in zip(results["cpu"], results["cuda"]):
        assert gpu.token_ids == cpu.token_ids
        diff = max(abs(a - b) for a, b in zip(gpu.logprobs, cpu.logprobs))
        assert diff < tol, diff
