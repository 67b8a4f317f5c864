"""Tools an augmented request can call: a registry, and the built-ins.

A tool is an async function `fn(args) -> str | list[int]` with an API type, an
expected duration and a timeout. A `str` result is tokenized by the runtime; a
`list[int]` is taken as token ids. Anything else is a fault of that request.

Built-ins:
- `calculator`: arithmetic on numbers (+ - * / // % **, unary -, parentheses),
  evaluated from Python's AST with a whitelist; no names, calls or attributes.
- `http_get`: GET a URL (`args` is the URL, or {"url": ..., "max_bytes": ...}) in a
  thread with the tool's timeout; returns the body's text (first `max_bytes`).
- `sleep`: waits `args["duration_s"]` and returns `args["tokens"]` (token ids) or
  `args["text"]`: an API of given duration and answer, for trace replay.

This module does not import vllm.
"""

from __future__ import annotations

import ast
import asyncio
import operator
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from marsched.workload.model import ApiType

ToolFn = Callable[[Any], Awaitable[Any]]


class ToolError(RuntimeError):
    """A tool call failed: it raised, timed out, or returned something unusable."""


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    fn: ToolFn
    api_type: ApiType = ApiType.OTHER
    expected_duration_s: float = 1.0
    expected_return_tokens: int = 20
    timeout_s: float = 60.0


class ToolRegistry:
    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}

    def register(
        self,
        name: str,
        fn: ToolFn,
        api_type: ApiType | str = ApiType.OTHER,
        expected_duration_s: float = 1.0,
        expected_return_tokens: int = 20,
        timeout_s: float = 60.0,
    ) -> Tool:
        if not asyncio.iscoroutinefunction(fn):
            raise TypeError(f"tool {name!r}: register an async function (got {fn!r})")
        if timeout_s <= 0 or expected_duration_s < 0:
            raise ValueError(f"tool {name!r}: timeout must be > 0 and expected duration >= 0")
        tool = Tool(name, fn, ApiType(api_type), expected_duration_s, expected_return_tokens, timeout_s)
        self._tools[name] = tool
        return tool

    def tool(self, name: str | None = None, **kwargs: Any) -> Callable[[ToolFn], ToolFn]:
        """Decorator form of `register`."""

        def wrap(fn: ToolFn) -> ToolFn:
            self.register(name or fn.__name__, fn, **kwargs)
            return fn

        return wrap

    def get(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise ToolError(f"unknown tool {name!r}; registered: {sorted(self._tools)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def names(self) -> list[str]:
        return sorted(self._tools)

    async def call(self, name: str, args: Any, timeout_s: float | None = None) -> Any:
        """Run a tool under its timeout; every failure becomes a `ToolError` naming the tool."""
        tool = self.get(name)
        timeout = timeout_s if timeout_s is not None else tool.timeout_s
        try:
            return await asyncio.wait_for(tool.fn(args), timeout)
        except asyncio.TimeoutError:
            raise ToolError(f"tool {name!r} timed out after {timeout:g} s") from None
        except ToolError:
            raise
        except Exception as error:  # noqa: BLE001 - any tool failure ends only its request
            raise ToolError(f"tool {name!r} raised {type(error).__name__}: {error}") from error


# --- built-ins ------------------------------------------------------------------------

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_POWER = 1000


def safe_eval(expression: str) -> int | float:
    """Evaluate arithmetic on numeric literals; anything else raises ValueError."""

    def visit(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return visit(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = visit(node.left), visit(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POWER:
                raise ValueError(f"exponent {right} too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](visit(node.operand))
        raise ValueError(f"not allowed in a calculator expression: {ast.dump(node)[:60]}")

    if len(expression) > 1000:
        raise ValueError("expression longer than 1000 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from error
    return visit(tree)


async def calculator(args: Any) -> str:
    expression = args["expression"] if isinstance(args, dict) else str(args)
    value = safe_eval(expression)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _get(url: str, timeout_s: float, max_bytes: int) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"only http(s) URLs are allowed, got {url!r}")
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - scheme checked above
        return response.read(max_bytes).decode("utf-8", errors="replace")


async def http_get(args: Any, timeout_s: float = 10.0) -> str:
    if isinstance(args, dict):
        url, max_bytes = args["url"], int(args.get("max_bytes", 4096))
        timeout_s = float(args.get("timeout_s", timeout_s))
    else:
        url, max_bytes = str(args), 4096
    return await asyncio.to_thread(_get, url, timeout_s, max_bytes)


async def sleep(args: Any) -> Any:
    await asyncio.sleep(float(args.get("duration_s", 0.0)))
    if "tokens" in args:
        return list(args["tokens"])
    return str(args.get("text", ""))


def default_tools() -> ToolRegistry:
    registry = ToolRegistry()
    registry.register("calculator", calculator, ApiType.MATH, expected_duration_s=0.001, expected_return_tokens=4,
                      timeout_s=5.0)
    registry.register("http_get", http_get, ApiType.QA, expected_duration_s=1.0, expected_return_tokens=200,
                      timeout_s=10.0)
    registry.register("sleep", sleep, ApiType.OTHER, expected_duration_s=1.0, expected_return_tokens=20,
                      timeout_s=3600.0)
    return registry
