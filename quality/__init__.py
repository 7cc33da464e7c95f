"""Quality harness: synthetic long-context tasks, a tiny model trained on them, and per-method accuracy.

`quality.tasks` generates seeded samples (prompt token ids + the exact answer token ids), `quality.train`
trains the shipped checkpoint, `quality.eval` measures every method through the real engine. Nothing in the
project imports this package (import-linter keeps it on top of the layers).
"""
