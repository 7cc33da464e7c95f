"""PNG plots of a replay: prefilled tokens per turn and KV pages per turn, one line per configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plots(summaries: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Needs matplotlib (``pip install agentrt[replay]``); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, ylabel, name in (("prefilled_per_turn", "prefilled tokens (mean over sessions)", "prefilled_per_turn.png"),
                              ("kv_pages_per_turn", "KV pages in use while the turn ran", "kv_pages_per_turn.png")):
        fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
        for s in summaries:
            ax.plot(range(len(s[key])), s[key], marker=".", label=s["config"])
        ax.set_xlabel("turn")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
