"""A user's mistake on the `agentrt` command line prints one line to stderr that names the flag and the fix, and
exits with status 2, never a traceback; every command's help is written for users (no module paths, a help
text for every option, defaults shown).

The mistakes a new user meets run as their own processes, as the user would meet them, with no GPU visible;
the rest run in this process through the same entry point (each process costs an interpreter and often a
torch import). None loads a model.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NO_CONFIG = "{tmp}/empty-model"  # a directory without config.json
GPT2 = "{tmp}/gpt2-model"  # a config.json of an architecture the engine has no code for
DB = "sqlite+aiosqlite:///{tmp}/keys.db"

# (argv, the flag the line names, a piece of the message: what is wrong or the fix)
IN_A_PROCESS = [
    (["generate", "--model", "/nope"], "--model", "/nope is not a directory"),
    (["generate", "--model", NO_CONFIG], "--model", "has no config.json"),
    (["serve", "--device", "cuda"], "--device", "no CUDA device is visible (torch.cuda.is_available() is False); "
                                                "use --device cpu or --device auto"),
    (["serve", "--db", "sqlite:///x.db"], "--db", "use sqlite+aiosqlite:///x.db"),
    (["serve", "--db", "postgresql://agent@db.example/agentrt"], "--db",
     "use postgresql+asyncpg://agent@db.example/agentrt"),
    (["serve", "--model", "/nope"], "--model", "/nope is not a directory"),
    (["serve", "--method", "nope"], "--method", "choose one of dense"),
    (["serve", "--kv-storage", "nope"], "--kv-storage", "choose one of fp8"),
    (["serve", "--tp", "0"], "--tp", "expected an integer >= 1"),
    (["serve", "--replicas", "0"], "--replicas", "expected an integer >= 1"),
    (["serve", "--replicas", "2", "--http-replicas", "0"], "--http-replicas", "expected an integer >= 1"),
    (["keys", "list", "--db", "sqlite:///x.db"], "--db", "use sqlite+aiosqlite:///x.db"),
    (["bench", "--shape", "nope"], "--shape", "'qwen3-4b'"),
    (["bench", "--model", "/nope"], "--model", "/nope is not a directory"),
    (["eval", "--model", "/nope"], "--model", "/nope is not a directory"),
    (["eval", "--methods", "snapkv,nope"], "--methods", "known: dense"),
    (["replay", "run", "--model", "/nope"], "--model", "/nope is not a directory"),
    (["replay", "run", "--turns", "8,2"], "--turns", "LO <= HI"),
    (["replay", "run", "--traces", "/nope"], "--traces", "does not exist"),
    # the embedded model holds 4096 tokens: 60 turns of outputs and tool calls alone do not fit
    (["replay", "run", "--turns", "60,60", "--device", "cpu"], "--turns", "lower --turns"),
]
IN_THIS_PROCESS = [
    (["generate", "--max-tokens", "0"], "--max-tokens", "expected an integer >= 1"),
    (["serve", "--model", NO_CONFIG], "--model", "has no config.json"),
    (["serve", "--model", GPT2], "--model", "'GPT2LMHeadModel' is not supported"),
    (["generate", "--model", GPT2], "--model", "'GPT2LMHeadModel' is not supported"),
    (["serve", "--db", "sqlite+aiosqlite:///no/such/dir/x.db"], "--db", "does not exist"),
    (["serve", "--db", "nope"], "--db", "is not a database URL"),
    (["serve", "--method", "snapkv", "--method-config", '{"budget": 0}'], "--method-config", "budget"),
    (["serve", "--kv-storage-config", '{"bits": 2}'], "--kv-storage-config", "--kv-storage is not"),
    (["serve", "--tp", "3", "--device", "cpu"], "--tp", "must divide"),
    (["serve", "--num-pages", "0"], "--num-pages", "expected an integer >= 1"),
    (["serve", "--kv-cache-memory", "lots"], "--kv-cache-memory", "512MiB"),
    (["serve", "--num-pages", "8", "--kv-cache-memory", "1GiB"], "--kv-cache-memory", "not allowed"),
    (["serve", "--port", "70000"], "--port", "0..65535"),
    (["serve", "--host", "0.0.0.0", "--no-auth"], "--host 0.0.0.0", "refusing to serve without API keys"),
    (["serve", "--host", "0.0.0.0", "--db", DB], "--host 0.0.0.0", "agentrt keys create --tenant NAME --db"),
    (["keys", "create", "--db", "postgresql://h/db", "--tenant", "acme"], "--db", "postgresql+asyncpg://h/db"),
    (["keys", "create", "--tenant", "bad tenant!", "--db", DB], "--tenant", "tenant names are"),
    (["keys", "create", "--db", DB], "the following arguments are required: --tenant", ""),
    (["demo", "--url", "localhost"], "--url", "http://"),
    (["bench", "--batch", "1,0"], "--batch", "integers >= 1"),
    (["bench", "--cases", "1@x"], "--cases", "batch@context"),
    (["make-tiny", "--arch", "nope", "--out", "{tmp}/tiny"], "--arch", "invalid choice"),
    (["eval", "--model", NO_CONFIG], "--model", "has no config.json"),
    (["eval", "--budgets", "0"], "--budgets", "(0, 1]"),
    (["eval", "--lengths", "8192"], "--lengths", "the model's context of 4096"),
    (["eval", "--knobs", "{nope"], "--knobs", "is not JSON"),
    (["eval", "--rounds", "1"], "--rounds", ">= 2"),
    (["replay", "run", "--model", NO_CONFIG], "--model", "has no config.json"),
    (["replay", "run", "--shape", "nope"], "--shape", "'tiny'"),
    (["replay", "run", "--configs", "dense-chain,nope"], "--configs", "known: dense-noprefix"),
    (["replay", "run", "--output-tokens", "2,4"], "--output-tokens", ">= 8"),
    (["replay", "run", "--snapkv-config", "{nope"], "--snapkv-config", "is not JSON"),
    (["replay", "run", "--engine-options", '{"nope": 1}'], "--engine-options", "unknown engine option"),
    (["replay", "plot", "/nope"], "report", "does not exist"),
    (["nope"], "COMMAND", "invalid choice"),
]


def _prog(argv: list[str]) -> str:
    """The command a line starts with: agentrt, agentrt serve, agentrt replay run, ..."""
    if argv[0] not in ("generate", "serve", "keys", "demo", "bench", "make-tiny", "eval", "replay"):
        return "agentrt"
    return " ".join(["agentrt", *argv[:2 if argv[0] in ("keys", "replay") else 1]])


def _check(argv: list[str], flag: str, fix: str, code, out: str, err: str) -> None:
    assert "Traceback" not in out + err, err
    assert code == 2, (code, err)
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"{_prog(argv)}: {flag}"), err
    assert fix in err, err


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    (tmp_path / "empty-model").mkdir()
    (tmp_path / "gpt2-model").mkdir()
    (tmp_path / "gpt2-model" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AGENTRT_CACHE", str(tmp_path / "cache"))
    return tmp_path


@pytest.mark.parametrize("argv, flag, fix", IN_A_PROCESS, ids=[" ".join(a) for a, _, _ in IN_A_PROCESS])
def test_a_mistake_prints_one_line_naming_the_flag(tmp, argv, flag, fix):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    argv = [a.replace("{tmp}", str(tmp)) for a in argv]
    result = subprocess.run([sys.executable, "-m", "agentrt.cli", *argv], capture_output=True, text=True, env=env,
                            timeout=120)
    _check(argv, flag, fix, result.returncode, result.stdout, result.stderr)


@pytest.mark.parametrize("argv, flag, fix", IN_THIS_PROCESS, ids=[" ".join(a) for a, _, _ in IN_THIS_PROCESS])
def test_more_mistakes_print_one_line_naming_the_flag(tmp, capsys, argv, flag, fix):
    from agentrt.cli import main

    argv = [a.replace("{tmp}", str(tmp)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # the parser's mistakes exit, as they do from a shell
        code = exc.code
    out, err = capsys.readouterr()
    _check(argv, flag, fix, code, out, err)


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["replay", "run", "--help"]], ids=" ".join)
def test_help_runs_as_the_agentrt_command(argv):
    result = subprocess.run([sys.executable, "-m", "agentrt.cli", *argv], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert re.match(r"usage: agentrt\b", result.stdout) and "python -m" not in result.stdout


class _Parsed(Exception):
    pass


def _parser_of(entry, argv: list[str]) -> argparse.ArgumentParser:
    """The parser a command's main builds (caught as it parses, before anything runs)."""
    original = argparse.ArgumentParser.parse_args

    def catch(self, *args, **kwargs):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_args = catch
    try:
        entry(argv)
    except _Parsed as parsed:
        return parsed.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError(f"{entry} parsed nothing")


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def _every_parser():
    from agentrt.cli import build_parser, _bench, _eval, _make_tiny
    from agentrt.replay.cli import build_parser as replay_parser

    yield from _all_parsers(build_parser())
    yield from _all_parsers(replay_parser())
    for entry in (_bench, _eval, _make_tiny):
        yield _parser_of(entry, [])


def test_every_option_has_help_and_shows_its_default():
    from benchmarks.model_shapes import SHAPES
    from engine.cli_args import HelpFormatter

    parsers = list(_every_parser())
    progs = {p.prog: p for p in parsers}
    assert {"agentrt serve", "agentrt bench", "agentrt eval", "agentrt make-tiny", "agentrt replay run",
            "agentrt keys list"} <= set(progs)
    missing, no_default = [], []
    for parser in parsers:
        assert "python -m" not in parser.format_help(), parser.prog
        formatter = parser._get_formatter()
        assert isinstance(formatter, HelpFormatter), parser.prog
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            name = "/".join(action.option_strings) or action.dest
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{parser.prog} {name}")
                continue
            default = action.default
            if action.option_strings and action.nargs != 0 and default not in (None, argparse.SUPPRESS) and \
                    "default" not in formatter._get_help_string(action):
                no_default.append(f"{parser.prog} {name}")
    assert not missing, f"options without help: {missing}"
    assert not no_default, f"options whose help hides the default: {no_default}"
    bench_help = " ".join(progs["agentrt bench"].format_help().split())
    assert all(name in bench_help for name in SHAPES)


def test_every_command_checks_its_model_device_and_database_flags_the_same_way():
    """Each command's --model, --device and --db go through the one check of each (tested above once)."""
    from agentrt.cli import db_url
    from engine.cli_args import checkpoint_dir, device

    checks = {"--model": checkpoint_dir, "--device": device, "--db": db_url}
    seen = {flag: set() for flag in checks}
    for parser in _every_parser():
        for action in parser._actions:
            for flag in set(action.option_strings) & set(checks):
                assert action.type is checks[flag], f"{parser.prog} {flag}"
                seen[flag].add(parser.prog)
    assert {"agentrt generate", "agentrt serve", "agentrt bench", "agentrt eval", "agentrt replay run"} <= \
        seen["--model"] & seen["--device"]
    assert {"agentrt serve", "agentrt keys create", "agentrt keys list", "agentrt keys revoke"} <= seen["--db"]


def test_keys_list_prints_a_header_and_iso_times(tmp_path, capsys):
    from agentrt.cli import main

    db = f"sqlite+aiosqlite:///{tmp_path / 'keys.db'}"
    assert main(["keys", "create", "--tenant", "acme", "--name", "ci bot", "--db", db]) == 0
    capsys.readouterr()
    assert main(["keys", "list", "--db", db]) == 0
    header, row = capsys.readouterr().out.strip().splitlines()
    assert header.split() == ["KEY", "ID", "TENANT", "STATE", "CREATED", "(UTC)", "NAME"]
    assert re.fullmatch(r"[0-9a-f]+ +acme +active +\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ +ci bot", row), row


def test_one_embedded_model():
    """The trained model is the one default: the engine's, the server's, and the package data's."""
    import tomllib

    import engine
    from agentrt.config import embedded_model_dir

    model = engine.embedded_model_dir()
    assert model == embedded_model_dir() and model.parent.parent == ROOT / "engine"
    assert (model / "training_config.json").is_file() and (model / "model.safetensors").is_file()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert f"{model.relative_to(ROOT / 'engine')}/*" in data["engine"]
