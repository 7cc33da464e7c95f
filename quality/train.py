"""Train the quality model: ``python -m quality.train --out DIR`` (GPU preset) or ``--preset cpu``.

A plain loop: AdamW, linear warm-up then cosine decay, bf16 autocast on a GPU, gradient clipping. Batches mix
the three tasks of `quality.tasks` at lengths drawn from a curriculum (short first, up to ``max_len``); the
loss is cross-entropy on the answer tokens (and the end token) plus ``lm_weight`` times the loss on every
other token. At the end the model is scored by teacher forcing (greedy emits the answer iff the argmax at
every answer position is the answer token) and saved with its training config and that evaluation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from quality.model import ModelShape, build_model, build_tokenizer, save_checkpoint
from quality.tasks import TASKS, end_token_id, make_sample

IGNORE = -100


@dataclass(slots=True)
class TrainConfig:
    steps: int = 3000
    tokens_per_batch: int = 65536
    min_len: int = 192
    max_len: int = 2304
    curriculum: int = 1200  # steps over which the longest sampled length grows from min_len to max_len
    lr: float = 1.5e-3
    warmup: int = 150
    weight_decay: float = 0.1
    lm_weight: float = 0.1
    task_mix: dict[str, float] = field(default_factory=lambda: {"needle": 0.4, "vartrack": 0.25, "tool_lookup": 0.35})
    seed: int = 0
    time_budget_s: float | None = None  # stop early (and anneal by elapsed time) to fit a wall-clock limit
    eval_samples: int = 64
    eval_lengths: tuple[int, ...] = (512, 1024, 2048)

    def __post_init__(self) -> None:
        if self.min_len < 64 or self.max_len < self.min_len:
            raise ValueError(f"need 64 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        unknown = set(self.task_mix) - set(TASKS)
        if unknown or not self.task_mix:
            raise ValueError(f"task_mix names unknown tasks {sorted(unknown)}; known: {TASKS}")


PRESETS = {
    "gpu": (ModelShape(), TrainConfig()),
    "cpu": (ModelShape(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=384),
            TrainConfig(steps=400, tokens_per_batch=4096, max_len=768, curriculum=100, lr=2e-3, warmup=40,
                        eval_samples=16, eval_lengths=(512, 768))),
}


def _sample_args(task: str, length: int, rng: random.Random) -> dict:
    if task == "needle":
        return {"num_keys": rng.randint(1, 6)}
    if task == "vartrack":
        return {"hops": rng.randint(1, 2), "num_chains": rng.randint(1, 4)}
    return {"note_words": rng.randint(4, 24)}


def make_batch(tokenizer, cfg: TrainConfig, step: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, labels, answer mask) for one step, right-padded; labels are the next tokens."""
    longest = cfg.min_len + (cfg.max_len - cfg.min_len) * min(1.0, step / max(1, cfg.curriculum))
    length = rng.randint(cfg.min_len, int(longest))
    end, pad = end_token_id(tokenizer), tokenizer.pad_token_id
    tasks, weights = zip(*cfg.task_mix.items())
    seqs = []
    for _ in range(max(1, cfg.tokens_per_batch // length)):
        task = rng.choices(tasks, weights)[0]
        s = make_sample(task, tokenizer, rng, length, rng.random(), **_sample_args(task, length, rng))
        seqs.append((s.prompt_ids + s.answer_ids + [end], len(s.prompt_ids)))
    width = max(len(ids) for ids, _ in seqs) - 1
    inputs = torch.full((len(seqs), width), pad, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    answer = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, (ids, prompt_len) in enumerate(seqs):
        n = len(ids) - 1
        inputs[row, :n] = torch.tensor(ids[:-1])
        labels[row, :n] = torch.tensor(ids[1:])
        answer[row, prompt_len - 1:n] = True
    return inputs, labels, answer


class _Batches(torch.utils.data.IterableDataset):
    def __init__(self, cfg: TrainConfig, shape: ModelShape):
        self.cfg, self.shape = cfg, shape

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nworkers = (info.id, info.num_workers) if info else (0, 1)
        tokenizer = build_tokenizer(self.shape, self.cfg.max_len * 2)
        for step in range(wid, self.cfg.steps, nworkers):
            yield make_batch(tokenizer, self.cfg, step, random.Random(self.cfg.seed * 1_000_003 + step))


def lr_at(cfg: TrainConfig, step: int, elapsed: float) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    if cfg.time_budget_s:
        progress = max(progress, elapsed / cfg.time_budget_s)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _loss(model, inputs, labels, answer, lm_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=inputs).logits.float()
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none")
    valid = labels != IGNORE
    answer_loss = per_token[answer].mean()
    lm_loss = per_token[valid & ~answer].mean()
    return answer_loss + lm_weight * lm_loss, answer_loss


@torch.no_grad()
def teacher_forced_accuracy(model, tokenizer, cfg: TrainConfig, device: torch.device) -> dict[str, dict[str, float]]:
    """Exact-match accuracy of greedy decoding, computed by teacher forcing, per task and length (held-out seed)."""
    model.eval()
    end, results = end_token_id(tokenizer), {}
    for task in TASKS:
        results[task] = {}
        for length in cfg.eval_lengths:
            rng, hits = random.Random(10_000_019 + length), 0
            for i in range(cfg.eval_samples):
                s = make_sample(task, tokenizer, rng, length, i / max(1, cfg.eval_samples - 1))
                ids = torch.tensor([s.prompt_ids + s.answer_ids + [end]], device=device)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    logits = model(input_ids=ids[:, :-1]).logits
                target = ids[0, len(s.prompt_ids):]
                hits += bool((logits[0, len(s.prompt_ids) - 1:].argmax(-1) == target).all())
            results[task][str(length)] = hits / cfg.eval_samples
    model.train()
    return results


def train(shape: ModelShape, cfg: TrainConfig, out_dir: Path, device: torch.device, workers: int) -> dict:
    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer(shape, shape.max_position_embeddings)
    model = build_model(shape, tokenizer).to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    loader = torch.utils.data.DataLoader(_Batches(cfg, shape), batch_size=None, num_workers=workers,
                                         prefetch_factor=4 if workers else None, persistent_workers=False)
    start, log, step = time.time(), [], 0
    model.train()
    for step, (inputs, labels, answer) in enumerate(loader):
        elapsed = time.time() - start
        if cfg.time_budget_s and elapsed > cfg.time_budget_s:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step, elapsed)
        inputs, labels, answer = inputs.to(device), labels.to(device), answer.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, answer_loss = _loss(model, inputs, labels, answer, cfg.lm_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step < 5:
            entry = {"step": step, "s": round(elapsed, 1), "len": inputs.shape[1], "loss": round(loss.item(), 4),
                     "answer_loss": round(answer_loss.item(), 4), "lr": opt.param_groups[0]["lr"]}
            log.append(entry)
            print(json.dumps(entry), flush=True)
    train_s = time.time() - start
    evaluation = teacher_forced_accuracy(model, tokenizer, cfg, device)
    print(json.dumps({"teacher_forced_accuracy": evaluation}), flush=True)
    save_checkpoint(model.cpu(), tokenizer, out_dir)
    record = {"shape": asdict(shape), "train": asdict(cfg), "steps_done": step + 1, "train_seconds": round(train_s, 1),
              "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
              "torch": torch.__version__, "log": log}
    (out_dir / "training_config.json").write_text(json.dumps(record, indent=1) + "\n")
    (out_dir / "train_eval.json").write_text(json.dumps({"method": "teacher_forced_greedy_exact_match",
                                                         "accuracy": evaluation}, indent=1) + "\n")
    return record


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m quality.train", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: gpu on CUDA, cpu otherwise")
    p.add_argument("--device", default="auto")
    p.add_argument("--steps", type=int)
    p.add_argument("--tokens-per-batch", type=int)
    p.add_argument("--max-len", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--time-budget", type=float, help="seconds of training before stopping (and annealing)")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--seed", type=int)
    p.add_argument("--eval-samples", type=int, help="held-out samples per task and length for the final score")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    shape, cfg = PRESETS[args.preset or ("gpu" if device.type == "cuda" else "cpu")]
    overrides = {"steps": args.steps, "tokens_per_batch": args.tokens_per_batch, "max_len": args.max_len,
                 "lr": args.lr, "time_budget_s": args.time_budget, "seed": args.seed,
                 "eval_samples": args.eval_samples}
    cfg = TrainConfig(**{**asdict(cfg), **{k: v for k, v in overrides.items() if v is not None}})
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    workers = args.workers if args.workers is not None else max(0, min(10, (os.cpu_count() or 2) - 4))
    record = train(shape, cfg, args.out, device, workers)
    print(json.dumps({k: record[k] for k in ("steps_done", "train_seconds", "device")}))


if __name__ == "__main__":
    main()
