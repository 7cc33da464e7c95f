"""The import-linter contract that keeps policies on the engine's contract names every other engine module:
a module added to engine/ without being listed would be importable by a method unnoticed."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {"engine.contract", "engine.registry", "engine.errors"}


def test_the_policies_contract_forbids_every_engine_module_but_the_contract():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in config if c.get("source_modules") == ["policies"]]
    modules = {f"engine.{p.stem}" for p in (ROOT / "engine").glob("*.py") if p.stem != "__init__"}
    modules |= {f"engine.{p.parent.name}" for p in (ROOT / "engine").glob("*/__init__.py")}
    assert set(contract["forbidden_modules"]) == modules - ALLOWED
