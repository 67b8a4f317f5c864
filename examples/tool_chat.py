"""A tool-calling chat against any OpenAI-compatible server: the model calls a calculator, the
client runs it and sends the result back, the model answers.

    python examples/tool_chat.py --url http://127.0.0.1:8000 --model /tmp/marsched-model --force

`--force` names the tool in `tool_choice`, so that a random-weight model (`marsched model`) writes
a valid call (the server needs `--structured-outputs-config` without whitespace for that); a real
model is asked with `tool_choice: auto`. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from marsched.vllm.tools import safe_eval

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"], "additionalProperties": False}}}


def chat(url: str, body: dict) -> dict:
    request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        sys.exit(f"tool_chat: the server answered {error.code}: {error.read().decode(errors='replace')}")
    except urllib.error.URLError as error:
        sys.exit(f"tool_chat: cannot reach {url}: {error.reason}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--force", action="store_true", help="name the tool in tool_choice")
    parser.add_argument("--question", default="What is 6*7? Use the calculator.")
    args = parser.parse_args()
    messages = [{"role": "user", "content": args.question}]
    choice = {"type": "function", "function": {"name": "calculator"}} if args.force else "auto"
    first = chat(args.url, {"model": args.model, "messages": messages, "tools": [CALCULATOR],
                            "tool_choice": choice, "max_tokens": 64})
    message = first["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    if not calls:
        print(f"the model answered without a call: {message.get('content')!r}")
        return
    messages.append({"role": "assistant", "content": message.get("content"), "tool_calls": calls})
    for call in calls:
        try:
            expression = json.loads(call["function"]["arguments"]).get("expression", "")
            result = str(safe_eval(str(expression)))
        except (ValueError, AttributeError, ZeroDivisionError, OverflowError) as error:
            result = f"error: {error}"
        print(f"call {call['function']['name']}({call['function']['arguments']}) -> {result}")
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    answer = chat(args.url, {"model": args.model, "messages": messages, "tools": [CALCULATOR], "max_tokens": 32})
    print(f"answer ({answer['choices'][0]['finish_reason']}): {answer['choices'][0]['message'].get('content')!r}")


if __name__ == "__main__":
    main()
