"""The tools file of `marsched serve --tools FILE`: the tools the server runs itself.

    {"tools": [{"name": "calculator", "builtin": "calculator"},
               {"name": "lookup", "function": "mypkg.mod:fn", "description": "...",
                "parameters": {...JSON schema...}, "expected_s": 1.0, "timeout_s": 10}],
     "max_rounds": 8}

A tool is a built-in of `marsched.vllm.tools` (`builtin`) or a Python callable
(`function`, "module:attribute"; sync or async, called with the arguments dict, returns
a str). Both are registered in a `ToolRegistry`, which runs them under their timeout.
Optional per tool: `description`, `parameters` (built-ins have defaults), `expected_s`
(the prior of its duration), `timeout_s`, `api_type` (the MARS API type), and for a sync
function `threads` (default 4): the threads of its own it runs in, so that calls that hang
hold that tool's threads and no other tool's.

`load_tools_config` checks everything, imports the functions, and raises
`ToolsConfigError` naming the file, the tool and the problem. It runs twice: in
`marsched serve` before vLLM starts (the user sees a mistake at once) and in the API
server, where `ServerToolsMiddleware` reads the path from `$MARSCHED_TOOLS`.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marsched.vllm.tools import Tool, ToolRegistry, default_tools
from marsched.workload.model import ApiType

ENV = "MARSCHED_TOOLS"
DEFAULT_MAX_ROUNDS = 8
MAX_ROUNDS = 100
TOOL_KEYS = ("name", "builtin", "function", "description", "parameters", "expected_s", "timeout_s", "api_type",
             "threads")
DEFAULT_THREADS = 4  # a sync function's own threads: what its hung calls can hold, and no more
MAX_THREADS = 256
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names

# What the model is told about each built-in (OpenAI function descriptions).
BUILTINS: dict[str, tuple[str, dict[str, Any]]] = {
    "calculator": ("Evaluate an arithmetic expression (+ - * / // % **, parentheses) and return the result.",
                   {"type": "object", "properties": {"expression": {"type": "string"}},
                    "required": ["expression"], "additionalProperties": False}),
    "http_get": ("Fetch an http(s) URL and return the start of its body as text.",
                 {"type": "object", "properties": {"url": {"type": "string"},
                                                   "max_bytes": {"type": "integer", "minimum": 1}},
                  "required": ["url"], "additionalProperties": False}),
    "sleep": ("Wait duration_s seconds, then return text.",
              {"type": "object", "properties": {"duration_s": {"type": "number", "minimum": 0},
                                                "text": {"type": "string"}},
               "required": ["duration_s"], "additionalProperties": False}),
}


class ToolsConfigError(ValueError):
    """The tools file is wrong; the message names the file, the tool and the problem."""


@dataclass(frozen=True, slots=True)
class ServerTool:
    tool: Tool  # the registry's entry: the async function, API type, expected duration, timeout
    description: str
    parameters: dict[str, Any]

    @property
    def name(self) -> str:
        return self.tool.name

    def openai(self) -> dict[str, Any]:
        """The entry of a chat request's `tools` list that describes this tool to the model."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolsConfig:
    path: str
    tools: dict[str, ServerTool]
    registry: ToolRegistry
    max_rounds: int = DEFAULT_MAX_ROUNDS


def load_tools_config(path: str | Path) -> ToolsConfig:
    where = str(path)
    try:
        data = json.loads(Path(path).read_text(), parse_constant=_no_constant)
    except OSError as error:
        raise ToolsConfigError(f"tools file {where}: cannot read it ({error.strerror or error})") from None
    except (ValueError, RecursionError) as error:
        raise ToolsConfigError(f"tools file {where}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ToolsConfigError(f"tools file {where}: must be a JSON object with keys tools, max_rounds")
    unknown = sorted(str(k) for k in data if k not in ("tools", "max_rounds"))
    if unknown:
        raise ToolsConfigError(f"tools file {where}: unknown key {unknown[0]!r}; valid: tools, max_rounds")
    max_rounds = data.get("max_rounds", DEFAULT_MAX_ROUNDS)
    if type(max_rounds) is not int or not 1 <= max_rounds <= MAX_ROUNDS:
        raise ToolsConfigError(f"tools file {where}: max_rounds must be an integer from 1 to {MAX_ROUNDS}, "
                               f"got {max_rounds!r}")
    entries = data.get("tools")
    if not isinstance(entries, list) or not entries:
        raise ToolsConfigError(f"tools file {where}: tools must be a non-empty list of tool objects")
    registry = ToolRegistry()
    tools: dict[str, ServerTool] = {}
    for index, entry in enumerate(entries):
        label = f"tools[{index}]"
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            label += f" ({entry['name']!r})"
        try:
            spec = _tool(entry, registry)
        except ToolsConfigError as error:
            raise ToolsConfigError(f"tools file {where}: {label}: {error}") from None
        if spec.name in tools:
            raise ToolsConfigError(f"tools file {where}: {label}: the name is already used by another tool")
        tools[spec.name] = spec
    return ToolsConfig(where, tools, registry, max_rounds)


def _tool(entry: Any, registry: ToolRegistry) -> ServerTool:
    if not isinstance(entry, dict):
        raise ToolsConfigError(f"must be an object with keys {', '.join(TOOL_KEYS)}")
    unknown = sorted(str(k) for k in entry if k not in TOOL_KEYS)
    if unknown:
        raise ToolsConfigError(f"unknown key {unknown[0]!r}; valid: {', '.join(TOOL_KEYS)}")
    name = entry.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ToolsConfigError(f"name must be 1 to 64 letters, digits, _ or -, got {name!r}")
    if ("builtin" in entry) == ("function" in entry):
        raise ToolsConfigError("give exactly one of builtin (a marsched built-in) or function ('module:attribute')")
    if "builtin" in entry:
        if "threads" in entry:
            raise ToolsConfigError("threads is for a function tool (a built-in runs on the event loop)")
        builtin = entry["builtin"]
        if builtin not in BUILTINS:
            raise ToolsConfigError(f"builtin must be one of {', '.join(BUILTINS)}, got {builtin!r}")
        base = default_tools().get(builtin)
        fn, description, parameters = base.fn, *BUILTINS[builtin]
        api_type, expected_s, timeout_s = base.api_type, base.expected_duration_s, base.timeout_s
    else:
        threads = entry.get("threads", DEFAULT_THREADS)
        if type(threads) is not int or not 1 <= threads <= MAX_THREADS:
            raise ToolsConfigError(f"threads must be an integer from 1 to {MAX_THREADS}, got {threads!r}")
        fn, doc = _function(entry["function"], name, threads)
        description, parameters = doc, {"type": "object", "properties": {}}
        api_type, expected_s, timeout_s = ApiType.OTHER, 1.0, 60.0
    description = entry.get("description", description)
    if not isinstance(description, str):
        raise ToolsConfigError(f"description must be a string, got {type(description).__name__}")
    parameters = entry.get("parameters", parameters)
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ToolsConfigError('parameters must be a JSON schema object with "type": "object"')
    expected_s = _seconds(entry.get("expected_s", expected_s), "expected_s", zero_ok=True)
    timeout_s = _seconds(entry.get("timeout_s", timeout_s), "timeout_s", zero_ok=False)
    try:
        api_type = ApiType(entry.get("api_type", api_type))
    except ValueError:
        raise ToolsConfigError(f"api_type must be one of {', '.join(t.value for t in ApiType)}, "
                               f"got {entry.get('api_type')!r}") from None
    tool = registry.register(name, fn, api_type, expected_duration_s=expected_s, timeout_s=timeout_s)
    return ServerTool(tool, description, parameters)


def _function(target: Any, name: str, threads: int) -> tuple[Any, str]:
    """Import "module:attribute" and make it async (a sync function runs in one of `threads`
    threads of its own, off the event loop)."""
    if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
        raise ToolsConfigError(f"function must be 'module:attribute', got {target!r}")
    module_name, attribute = target.split(":")
    try:
        value: Any = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure is the file's problem to report
        raise ToolsConfigError(f"function {target!r}: cannot import {module_name} "
                               f"({type(error).__name__}: {error})") from None
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise ToolsConfigError(f"function {target!r}: {module_name} has no attribute {attribute!r}")
        value = getattr(value, part)
    if not callable(value):
        raise ToolsConfigError(f"function {target!r} is not callable")
    doc = (inspect.getdoc(value) or "").strip().split("\n\n")[0].replace("\n", " ")
    if inspect.iscoroutinefunction(value):
        return value, doc
    fn = value
    # Its own threads, not the event loop's default pool: a call that hangs (past its timeout the
    # thread runs on, as Python cannot stop it) holds one of this tool's threads only.
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"marsched-tool-{name}")

    async def call(args: Any) -> Any:
        result = await asyncio.get_running_loop().run_in_executor(pool, fn, args)
        return await result if inspect.isawaitable(result) else result  # an object with an async __call__

    return call, doc


def _seconds(value: Any, key: str, zero_ok: bool) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ToolsConfigError(f"{key} must be a finite number of seconds {bound}, got {value!r}")
    return float(value)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")
