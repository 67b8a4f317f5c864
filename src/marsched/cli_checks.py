"""What every `marsched` command does with a bad option: one red line naming the flag, exit 2."""

from __future__ import annotations

import math
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

errors = Console(stderr=True)


def fail(message: str) -> NoReturn:
    errors.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True, emoji=False)
    raise typer.Exit(2)


def positive_numbers(text: str, flag: str, example: str) -> list[float]:
    """A comma-separated list of finite numbers > 0, such as `--qps 3,4,5,6`."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        fail(f"{flag} {text!r}: give comma-separated numbers, e.g. {example}")
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        fail(f"{flag} {text!r}: give finite numbers > 0, e.g. {example}")
    return values
