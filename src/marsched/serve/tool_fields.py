"""The check of a chat request's `tools` that vLLM 0.32 gets wrong when `tool_choice` names a function.

vLLM's `ChatCompletionRequest.check_tool_usage` runs before pydantic validates the fields, and
with a named `tool_choice` it looks up `tool["function"]["name"]` in every entry of `tools`: a
tool without a `function` object is then a KeyError, answered with HTTP 500, and a `tools` that
is a string is a TypeError whose 400 names no field ("string indices must be integers"). The
prediction middleware, which parses every chat body anyway, answers such a request with a 400
naming the field instead. A `tools` this check accepts is one pydantic's own validation accepts
too (an array of objects whose `function` is an object with a string `name`), so nothing vLLM
would serve is refused.
"""

from __future__ import annotations

from typing import Any


def tools_error(body: dict[str, Any]) -> tuple[str, str] | None:
    """(field, message) for a `tools` vLLM would crash on or answer without naming it; else None."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        return "tools", f"tools must be an array of tool objects, not {type(tools).__name__}"
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            return where, f"{where} must be an object, not {type(tool).__name__}"
        function = tool.get("function")
        if not isinstance(function, dict):
            return f"{where}.function", f"{where}.function must be an object with a name"
        if not isinstance(function.get("name"), str):
            return f"{where}.function.name", f"{where}.function.name must be a string"
    return None
