"""Walls between the parts: the engine names no method, and methods arrive by entry point."""

import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_GROUPS = ("agentrt.methods", "agentrt.kv_storage", "agentrt.scorers")
SPELLINGS = ["r-kv"]  # how prose writes a registered name (rkv)


def plugin_names() -> list[str]:
    """Every registered method, codec and scorer: its entry-point name and its module's, with and without
    underscores, so that a plugin added later is covered without a list to keep up."""
    found = [ep for group in PLUGIN_GROUPS for ep in entry_points(group=group)]
    names = {ep.name for ep in found} | {ep.value.split(":")[0].rsplit(".", 1)[-1] for ep in found}
    return sorted(names | {n.replace("_", "") for n in names} | set(SPELLINGS))


def test_engine_names_no_method():
    names = plugin_names()
    assert {"snapkv", "h2o", "quest", "kivi", "knorm", "streamingllm"} <= set(names)  # found at all
    pattern = re.compile(r"(\b|_)(" + "|".join(map(re.escape, names)) + r")", re.IGNORECASE)
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


def test_importing_the_engine_and_server_leaves_torch_compile_unloaded():
    """torch._dynamo costs about a second to import: the engine, the CLI and the server import it only where a
    path runs that needs it (e.g. ``engine.latent_expansion`` imports ``causal_lower_right`` in the function)."""
    code = (
        "import sys, engine.llm_engine, engine.llm, agentrt.cli, agentrt.app;"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
