"""Walls between the parts: the engine names no method, and methods arrive by entry point."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHOD_NAMES = ["streaming_llm", "streamingllm", "snapkv", "pyramidkv", "h2o", "quest", "omnikv", "kvzip", "kivi",
                "r-kv", "tova", "knorm", "retroinfer", "palu", "turboquant"]


def test_engine_names_no_method():
    pattern = re.compile(r"(\b|_)(" + "|".join(map(re.escape, METHOD_NAMES)) + r")", re.IGNORECASE)
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "engine").rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


def test_methods_are_found_by_entry_point_without_importing_policies():
    code = (
        "import sys; from engine.registry import available_methods, create_method;"
        "assert 'policies' not in sys.modules;"
        "names = available_methods(); print(names);"
        "assert {'streaming_llm','snapkv','pyramidkv','h2o','quest','omnikv'} <= set(names);"
        "assert create_method('snapkv', {'budget': 64}).config.budget == 64"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
