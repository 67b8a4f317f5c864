"""The probe's server-side tools: one that works and one for each way a tool fails.

`write_tools_file(folder)` writes the `--tools` file (docs/tools.md) that names them; the
server imports them from this module, so nothing but marsched needs to be installed.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

from marsched.experiments.probe.fields import WEATHER

CITY = WEATHER["function"]["parameters"]  # arguments the random-weight model fills (fields.py)
HANG_S = 30.0  # far past its timeout: the call holds one of its tool's threads that long


async def sleepy(args: dict) -> str:
    """The weather in a city, after a short wait."""
    await asyncio.sleep(random.uniform(0.05, 0.5))
    return f"sunny in {args.get('city')}"


def broken(args: dict) -> str:
    """A tool that raises."""
    raise RuntimeError("the probe's broken tool")


def hung(args: dict) -> str:
    """A sync tool that hangs past its timeout."""
    time.sleep(HANG_S)
    return "too late"


async def stalled(args: dict) -> str:
    """An async tool that hangs past its timeout (it is cancelled)."""
    await asyncio.sleep(HANG_S)
    return "too late"


def garbage(args: dict) -> str:
    """A result no tokenizer or JSON parser takes: a NUL and a lone surrogate."""
    return "a\x00b\ud800c"


def number(args: dict) -> int:
    """A result that is not a string."""
    return 42


TOOLS = ("sleepy", "broken", "hung", "stalled", "garbage", "number")


def write_tools_file(folder: Path) -> Path:
    def entry(name: str, **extra) -> dict:
        return {"name": name, "function": f"{__name__}:{name}", "parameters": CITY, **extra}

    config = {"tools": [entry("sleepy", expected_s=0.3), entry("broken"), entry("hung", timeout_s=1, threads=2),
                        entry("stalled", timeout_s=1), entry("garbage"), entry("number")],
              "max_rounds": 3}
    path = folder / "probe-tools.json"
    path.write_text(json.dumps(config))
    return path
