"""What every `marsched` command does with a bad option: one red line naming the flag, exit 2.

The checks of values live where the values are used (`marsched.bench.options` for the options
that runs share, a spec's `check()`), each raising ValueError that names the flag; `checked`
turns one into this line. Here are only the checks of the command line itself: lists in one
option, output paths, the trace to load, the packages a command needs.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import typer
from rich.markup import escape

from marsched.atomic import OutputPathError, check_output_path
from marsched.cli_output import errors

T = TypeVar("T")


def fail(message: str) -> NoReturn:
    errors.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True, emoji=False)
    raise typer.Exit(2)


def checked(check: Callable[[], T]) -> T:
    """`check()`; a ValueError (its message names the flag) fails the command."""
    try:
        return check()
    except ValueError as error:
        fail(str(error))


def positive_numbers(text: str, flag: str, example: str) -> list[float]:
    """A comma-separated list of finite numbers > 0, such as `--qps 3,4,5,6`."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        fail(f"{flag} {text!r}: give comma-separated numbers, e.g. {example}")
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        fail(f"{flag} {text!r}: give finite numbers > 0, e.g. {example}")
    return values


def whole_numbers(text: str, flag: str) -> tuple[int, ...]:
    """A comma-separated list of whole numbers, such as `--decode-batches 1,4,16`."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        fail(f"{flag} {text!r}: give comma-separated whole numbers, e.g. 1,4,16")


def comma_names(text: str) -> list[str]:
    """The names of a comma-separated list, such as `--policies vllm,mars`, blanks dropped."""
    return [name.strip() for name in text.split(",") if name.strip()]


def check_outputs(**paths: Path | None) -> None:
    """Every output path must be writable before any work starts (flag names: json_path -> --json)."""
    for name, path in paths.items():
        if path is not None:
            try:
                check_output_path(path)
            except OutputPathError as error:
                fail(f"{_flag_name(name)} {path}: {error}")


def _flag_name(name: str) -> str:
    return {"json_path": "--json"}.get(name, "--" + name.replace("_", "-"))


def existing_folder(flag: str, path: Path) -> None:
    """The folder `path` is written in must exist (bench and calibrate create no folders)."""
    if not path.parent.is_dir():
        fail(f"{flag} {path}: directory {path.parent} does not exist")


def write_or_fail(flag: str, path: Path, write: Callable[[], Any]) -> None:
    try:
        write()
    except OSError as error:
        fail(f"{flag} {path}: writing failed: {error.strerror or error}")


def load_trace_or_fail(trace: str, strict: bool) -> Any:
    """The trace's requests; a bad trace fails naming --trace (a file's errors already start with its path)."""
    from marsched.workload.loader import load_trace

    try:
        return load_trace(trace, strict=strict)
    except ValueError as error:
        message = str(error)
        fail(f"--trace {message}" if message.startswith(f"{trace}:") else f"--trace {trace}: {message}")


def need_modules(command: str, modules: tuple[str, ...] = ("vllm", "transformers")) -> None:
    """Fail, saying what to install, when a module the command needs is missing (found without importing it)."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            fail(f"marsched {command} needs {module}: pip install 'marsched[vllm]'")
