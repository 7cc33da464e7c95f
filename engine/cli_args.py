"""The command line's parser and argument types, shared by every ``agentrt`` command.

They live in the engine, the lowest layer with commands, so that the engine's commands (bench, make-tiny) and
the server's share them; nothing here imports torch unless a value needs it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, NoReturn


def one_line(text: object) -> str:
    return " ".join(str(text).split())


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; an option's help ends with its default unless it is a switch, has none or
    names it itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or action.nargs == 0 or default is None or default is argparse.SUPPRESS
                or "default" in text):
            return text  # a switch (its default is being off), or nothing worth showing
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class CommandLineParser(argparse.ArgumentParser):
    """A usage mistake prints one line to stderr, the command and the flag first, and exits with status 2 (a
    usage block above it would push the line that says what to fix out of view)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {one_line(message.removeprefix('argument '))}\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        parsed = super().parse_args(args, namespace)
        for parser, action in _chosen_actions(self, parsed):
            check, value = getattr(action.type, "check", None), getattr(parsed, action.dest, None)
            if check is not None and value is not None:
                try:
                    check(value)
                except argparse.ArgumentTypeError as exc:
                    parser.error(f"argument {'/'.join(action.option_strings) or action.dest}: {exc}")
        return parsed


def _chosen_actions(parser: argparse.ArgumentParser, parsed: argparse.Namespace):
    """(parser, action) of every option of the command line's parser and the subcommands it chose."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
            if chosen is not None:
                yield from _chosen_actions(chosen, parsed)
        else:
            yield parser, action


def checked_after_parsing(check):
    """Mark an argument type: ``check(value)`` runs once the whole command line has parsed (raising
    ArgumentTypeError for a mistake). Facts of this machine -- a directory, a GPU, an installed driver -- are
    checked there, so that parsing a command line depends on its text alone."""

    def mark(type_function):
        type_function.check = check
        return type_function

    return mark


def usage_error(prog: str, message: object) -> int:
    """Print a user mistake the way the parser does; returns the exit status."""
    print(f"{prog}: {one_line(message)}", file=sys.stderr)
    return 2


def _number(kind: type, text: str, what: str, ok) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, "an integer >= 1", lambda v: v >= 1)


def non_negative_int(text: str) -> int:
    return _number(int, text, "an integer >= 0", lambda v: v >= 0)


def non_negative_float(text: str) -> float:
    return _number(float, text, "a number >= 0", lambda v: v >= 0)


def fraction(text: str) -> float:
    return _number(float, text, "a number in (0, 1]", lambda v: 0 < v <= 1)


def _ints(text: str, least: int) -> list[int]:
    what = f"comma-separated integers >= {least}"
    values = [_number(int, part.strip(), what, lambda v: v >= least) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return values


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of integers >= 1."""
    return _ints(text, 1)


def non_negative_ints(text: str) -> list[int]:
    """A comma-separated list of integers >= 0."""
    return _ints(text, 0)


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"key\": 1}}', got {text!r}")
    return value


def _checkpoint_exists(text: str) -> None:
    path = Path(text)
    what = "give a local Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files)"
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory; {what}")
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text} has no config.json, so it is not a Hugging Face checkpoint; {what}")


@checked_after_parsing(_checkpoint_exists)
def checkpoint_dir(text: str) -> str:
    """A local Hugging Face checkpoint directory (config.json is checked before loading; the rest as it loads)."""
    return str(Path(text).expanduser())


def _device_visible(text: str) -> None:
    if not text.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r} needs a GPU, but no CUDA device is visible "
                                         "(torch.cuda.is_available() is False); use --device cpu or --device auto")
    index, count = int(text.partition(":")[2] or 0), torch.cuda.device_count()
    if index >= count:
        raise argparse.ArgumentTypeError(f"{text!r}: only {count} CUDA device(s) are visible (cuda:0 to "
                                         f"cuda:{count - 1})")


@checked_after_parsing(_device_visible)
def device(text: str) -> str:
    """auto, cpu or cuda[:N] (that GPU must be visible)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device the engine runs on; use --device auto, cpu or "
                                         "cuda[:N]")
    return text
