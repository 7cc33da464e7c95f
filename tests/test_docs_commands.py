"""Every shell command and Python snippet in README.md and docs/*.md works as written.

Each fenced ``bash`` / ``python`` block is read from the docs. Every ``agentrt ...`` and ``python -m ...`` command
is parsed by the real command-line parser (a renamed or removed flag fails here), and the commands that finish
in seconds on the embedded model are run as written (``/tmp/...`` paths moved under the test's temporary
folder, the server's port replaced by a free one). ``curl`` commands and Python snippets run against a live
server started by the test. A command that is not run says why in NOT_RUN; a new one that is neither run nor
listed fails the test, so the docs cannot drift unnoticed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.live_servers import agentrt_serve, free_port

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")

# commands that are not run (a regular expression matching their start), with the reason; their `agentrt` /
# `python -m` flags are still parsed
NOT_RUN = {
    r"python3 -m venv": "the install line: CI runs it on a fresh machine (.ci/run)",
    "python -m pytest": "the test suite itself",
    "createdb": "needs a PostgreSQL server; tests/server/test_postgres.py covers that setup",
    "MSWEA_CONFIGURED=1 mini": "a model-driven agent; tests/sdk/test_mini_swe.py runs mini-swe-agent against a server",
    r"PYTHONPATH=\$PWD python -m quality.eval --device cuda": "needs a GPU",
    "python -m quality.train": "trains for minutes; tests/test_quality.py trains a few steps",
    "python -m quality.eval": "evaluates for minutes; tests/test_quality.py runs the evaluation at a tiny size",
    "python -m benchmarks.sm90_launches": "compiles every kernel for sm_90a (minutes); its parser is checked",
    "agentrt eval": "evaluates for minutes; tests/test_quality.py runs the evaluation at a tiny size",
    "agentrt serve --method snapkv": "needs two ranks and PostgreSQL (its URL is elided)",
    "agentrt serve --host 0.0.0.0": "binds every interface; the key flow runs in tests/server/test_server_auth.py",
    "agentrt serve --db postgresql": "needs a PostgreSQL server",
    "agentrt keys create --tenant acme --db": "writes outside the test's folders",
    "curl -s localhost:8000/v1/chains -H": "needs the key of a server with auth on",
    "agentrt serve --replicas": "starts Ray and serves until interrupted; tests/server/test_scaleout_cli.py runs it",
    "pip install 'agentrt\\[scaleout\\]'": "the test extra installs Ray Serve (.ci/run)",
}
# commands run as written (after the /tmp and port rewrites), by a regular expression matching their start
RUN = ("agentrt generate ", "agentrt make-tiny ", "agentrt bench ", "agentrt demo$", "agentrt replay run ",
       r"agentrt serve( --port \d+)?$", "curl ")
SERVE = r"agentrt serve( --port \d+)?$"


def _matches(patterns, command: str) -> bool:
    return any(re.match(p, command) for p in patterns)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(lang: str) -> list[Block]:
    out = []
    for path in DOCS:
        lines, i = path.read_text().splitlines(), 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if m is None:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if m.group(1) == lang:
                out.append(Block(path, i + 1, lang, "\n".join(lines[i + 1: end])))
            i = end + 1
    return out


def commands(block: Block) -> list[str]:
    """Shell commands of a block: comments dropped, continuation lines (a trailing backslash or a quote still
    open) joined."""
    out, pending, joint = [], "", "\n"
    for raw in block.text.splitlines():
        if not pending and out and raw[:1].isspace() and raw.lstrip().startswith("["):
            out[-1] += " " + _strip_comment(raw).strip()  # a synopsis' options go on on the next line
            continue
        line = raw if pending else _strip_comment(raw)
        if not pending and not line:
            continue
        pending = f"{pending}{joint}{_strip_comment(raw, pending)}" if pending else line
        joint = "\n"  # inside an open quote the newline is part of the text
        if pending.endswith("\\"):
            pending, joint = pending[:-1].rstrip(), " "
            continue
        try:
            shlex.split(pending)
        except ValueError:  # a quote still open: the command goes on
            continue
        out.append(pending.strip())
        pending = ""
    assert not pending, f"{block.where}: unterminated command {pending!r}"
    return out


def _strip_comment(line: str, before: str = "") -> str:
    """``line`` up to a ``#`` that starts a shell comment (outside quotes, after a blank); ``before`` is the
    command's text so far (it may leave a quote open)."""
    quote = None
    for ch in before:
        if quote is None and ch in "'\"":
            quote = ch
        elif ch == quote:
            quote = None
    for i, ch in enumerate(line):
        if quote is None and ch in "'\"":
            quote = ch
        elif ch == quote:
            quote = None
        elif quote is None and ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def all_commands() -> list[tuple[Block, str]]:
    return [(b, c) for b in blocks("bash") for c in commands(b)]


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


def parse_only(argv: list[str], entry) -> argparse.Namespace:
    """Run a command line through the real parser and stop right after parsing (nothing is executed)."""
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_and_stop
    try:
        entry(argv)
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit as exc:
        raise AssertionError(f"the parser refused {shlex.join(argv)!r} (exit {exc.code})") from None
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError(f"{shlex.join(argv)!r} never reached a parser")


def _entry(words: list[str]):
    """(the argv, the main function) of a documented `agentrt ...` or `python -m ...` command; None otherwise."""
    words = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]  # leading environment assignments
    if words and words[0] == "agentrt":
        from agentrt.cli import main

        return words[1:], main
    if len(words) >= 3 and words[0] in ("python", "python3") and words[1] == "-m" and \
            words[2].split(".")[0] in ("agentrt", "engine", "quality", "benchmarks"):
        import importlib

        return words[3:], importlib.import_module(words[2]).main
    return None


def _synopsis_flags(command: str) -> set[str]:
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", command))


def test_every_documented_command_is_run_or_says_why_not():
    unclassified = [f"{b.where}: {c}" for b, c in all_commands() if not _matches((*RUN, *NOT_RUN), c)
                    and not _is_synopsis(c)]
    assert not unclassified, "add these to RUN or NOT_RUN:\n" + "\n".join(unclassified)
    documented = {c for _, c in all_commands()}
    stale = [p for p in (*RUN, *NOT_RUN) if not any(re.match(p, c) for c in documented)]
    assert not stale, f"no documented command starts with these any more: {stale}"


def _is_synopsis(command: str) -> bool:
    """``agentrt keys list [--tenant NAME]``: optional parts in brackets or placeholders in capitals."""
    return command.startswith("agentrt ") and (" [-" in command or re.search(r"\s[A-Z][A-Z_]+(\s|$)", command)
                                               is not None)


def _synopsis_checked(command: str) -> None:
    """A synopsis (``agentrt keys list [--tenant NAME]``): every flag it names is in that subcommand's help."""
    words = shlex.split(command)
    sub = []
    for w in words[1:]:
        if w.startswith(("-", "[")) or w.isupper():
            break
        sub.append(w)
    help_text = subprocess.run([sys.executable, "-m", "agentrt.cli", *sub, "--help"], capture_output=True,
                               text=True, check=True).stdout
    missing = sorted(f for f in set(re.findall(r"(--[a-z][a-z0-9-]*)", command)) if f not in help_text)
    assert not missing, f"`agentrt {' '.join(sub)}` has no {missing}"


@pytest.mark.parametrize("block_command", all_commands(), ids=lambda bc: f"{bc[0].where}:{bc[1][:40]}")
def test_documented_flags_parse(block_command):
    block, command = block_command
    if command.startswith("agentrt") and _is_synopsis(command):
        _synopsis_checked(command)
        return
    entries = [e for e in map(_entry, _simple_commands(command.replace("...", "x"))) if e is not None]
    if not entries:
        pytest.skip("runs no agentrt command")
    for argv, main in entries:
        parse_only(argv, main)


def _simple_commands(command: str) -> list[list[str]]:
    """The words of each command in ``a && b; c | d``."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    out: list[list[str]] = [[]]
    for word in lexer:
        if word in ("&&", "||", ";", "|", "&"):
            out.append([])
        else:
            out[-1].append(word)
    return [w for w in out if w]


# ---- the commands that run -----------------------------------------------------------------------------------

def _rewrite(command: str, tmp: Path, port: int) -> str:
    command = re.sub(r"/tmp/", f"{tmp}/", command)
    return command.replace("localhost:8000", f"127.0.0.1:{port}").replace("127.0.0.1:8000", f"127.0.0.1:{port}")


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    """`agentrt serve` as a user starts it (a subprocess, the embedded model), on a free port."""
    tmp = tmp_path_factory.mktemp("docs-server")
    with agentrt_serve(tmp) as (url, port):
        yield url, port, tmp


def _run(args: list[str] | str, tmp: Path, timeout: float = 240, env: dict | None = None,
         shell: bool = False) -> subprocess.CompletedProcess:
    r = subprocess.run(args, shell=shell, capture_output=True, text=True, timeout=timeout, cwd=tmp,
                       env={**os.environ, **(env or {})}, executable="/bin/bash" if shell else None)
    assert r.returncode == 0, f"{args!r} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _cli_commands(pattern: str) -> list[tuple[Block, str]]:
    return [(b, c) for b, c in all_commands() if re.match(pattern, c) and not _is_synopsis(c)]


@pytest.mark.parametrize("prefix", ["agentrt generate ", "agentrt make-tiny ", "agentrt bench ", "agentrt demo$",
                                    "agentrt replay run "])
def test_documented_cli_command_runs(prefix, tmp_path):
    found = _cli_commands(prefix)
    assert found, f"no documented command starts with {prefix!r}"
    for block, command in found:
        words = shlex.split(_rewrite(command, tmp_path, 0))
        r = _run([sys.executable, "-m", "agentrt.cli", *words[1:]], tmp_path, env={"AGENTRT_CACHE": str(tmp_path)})
        assert "Traceback" not in r.stderr, f"{block.where}: {command}\n{r.stderr[-3000:]}"


def test_documented_serve_starts_and_answers(tmp_path):
    [(block, command)] = [(b, c) for b, c in all_commands() if re.fullmatch(r"agentrt serve --port \d+", c)]
    assert any(re.match(SERVE, c) for _, c in all_commands())
    port = free_port()
    words = shlex.split(command.replace("8000", str(port)))
    proc = subprocess.Popen([sys.executable, "-m", "agentrt.cli", *words[1:]], cwd=tmp_path,
                            env={**os.environ, "AGENTRT_CACHE": str(tmp_path), "HOME": str(tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
                time.sleep(0.2)
        assert health.status_code == 200 and health.json()["status"] == "ok", f"{block.where}: {health.text}"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def _python_blocks(name: str) -> list[Block]:
    return [b for b in blocks("python") if b.path.name == name]


def _run_python(code: str, tmp: Path, port: int, where: str) -> str:
    script = tmp / "snippet.py"
    script.write_text(_rewrite(code, tmp, port))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env={**os.environ, "AGENTRT_CACHE": str(tmp)})
    assert r.returncode == 0, f"{where} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r.stdout


def test_readme_python_snippet_runs(tmp_path):
    [block] = _python_blocks("README.md")
    out = _run_python(block.text, tmp_path, 0, block.where)
    assert out.strip(), "the snippet prints the generated text"


def test_adding_a_method_snippet_registers_a_method(tmp_path):
    [block] = _python_blocks("adding-a-method.md")
    check = "\nfrom engine.registry import METHODS\nassert METHODS.get('my-method') is MyMethod\n"
    _run_python(block.text + check, tmp_path, 0, block.where)


# Python blocks that are not run (a document and a text the block holds), with the reason
PYTHON_NOT_RUN = {
    ("sdk.md", "DefaultAgent("): "a model-driven agent for up to 30 steps; tests/sdk/test_mini_swe.py runs the adapter",
    ("server.md", "command.revision("):
        "writes a migration into the package; tests/server/test_migrations.py autogenerates",
}


def _session(blocks_: list[Block]) -> str:
    """One script running a document's blocks in order in one namespace (a block may use an earlier one's
    names, as a reader does), saying which block failed."""
    lines = ["import sys, traceback", "ns = {'__name__': '__main__'}"]
    for b in blocks_:
        lines += [f"print('--- {b.where}', flush=True)", f"exec(compile({b.text!r}, {b.where!r}, 'exec'), ns)"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("doc", ["api.md", "sdk.md"])
def test_doc_python_snippets_run_against_a_live_server(doc, live_server):
    url, port, tmp = live_server
    found = [b for b in _python_blocks(doc) if not any(d == doc and text in b.text for d, text in PYTHON_NOT_RUN)]
    assert found
    _run_python(_session(found), tmp, port, doc)


def test_python_blocks_not_run_are_still_documented():
    for (doc, text), reason in PYTHON_NOT_RUN.items():
        assert any(text in b.text for b in _python_blocks(doc)), f"{doc} has no block with {text!r} any more"


def test_documented_curl_commands_run_against_a_live_server(live_server):
    url, port, tmp = live_server
    found = [(b, c) for b, c in all_commands() if c.startswith("curl ") and "Authorization" not in c]
    assert found
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for block, command in found:
        chain = httpx.post(f"{url}/v1/chains", json={"tools": tools}).json()["id"]
        # a turn first, so that prune / fork / rewind have something to work on
        httpx.post(f"{url}/v1/chains/{chain}/turns", timeout=60,
                   json={"messages": [{"role": "user", "content": "Weather in Paris? " * 20}],
                         "sampling": {"max_tokens": 4}}).raise_for_status()
        shell = _rewrite(command, tmp, port).replace("curl ", "curl --fail-with-body ", 1)
        r = _run(shell, tmp, shell=True, timeout=120, env={"ID": chain})
        lines = r.stdout.strip().splitlines()
        assert lines, f"{block.where}: {command} printed nothing"
        data = [line.removeprefix("data:").strip() for line in lines if line.startswith("data:")]  # an SSE stream
        for text in data or [r.stdout]:
            json.loads(text)
