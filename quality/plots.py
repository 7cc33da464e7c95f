"""Plots of an eval run: accuracy vs budget per method, and a depth x length heatmap per method."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def accuracy_vs_budget(rows: list[dict], dense: dict[str, float], path: Path) -> Path:
    """One panel per task: mean accuracy over lengths and depths against the budget; dense as a line."""
    plt = _pyplot()
    tasks = sorted({r["task"] for r in rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        acc: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in rows:
            if r["task"] == task and r["method"] != "dense":
                acc[r["method"]][r["budget"]].append(r["accuracy"])
        for method, by_budget in sorted(acc.items()):
            budgets = sorted(by_budget)
            ax.plot(budgets, [sum(by_budget[b]) / len(by_budget[b]) for b in budgets], marker="o", label=method)
        if task in dense:
            ax.axhline(dense[task], color="black", linestyle="--", label="dense")
        ax.set(title=task, xlabel="KV budget (fraction of the prompt)", ylabel="accuracy", ylim=(-0.03, 1.03))
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def depth_length_heatmap(rows: list[dict], task: str, budget: float, path: Path) -> Path:
    """One heatmap per method (dense included) at ``budget``: rows = needle depth, columns = context length."""
    plt = _pyplot()
    chosen = [r for r in rows if r["task"] == task and (r["method"] == "dense" or r["budget"] == budget)]
    methods = sorted({r["method"] for r in chosen}, key=lambda m: (m != "dense", m))
    depths = sorted({r["depth"] for r in chosen})
    lengths = sorted({r["length"] for r in chosen})
    cols = min(5, len(methods))
    nrows = -(-len(methods) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(2.6 * cols, 2.4 * nrows), squeeze=False)
    for ax in axes.flat[len(methods):]:
        ax.axis("off")
    for ax, method in zip(axes.flat, methods):
        grid = [[float("nan")] * len(lengths) for _ in depths]
        for r in chosen:
            if r["method"] == method:
                grid[depths.index(r["depth"])][lengths.index(r["length"])] = r["accuracy"]
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=7)
        ax.set_title(method if method == "dense" else f"{method} @ {budget:g}", fontsize=8)
    fig.supxlabel("context length (tokens)", fontsize=8)
    fig.supylabel("needle depth", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
