"""OpenAI-compatible serving with MARS on vLLM: `marsched serve MODEL`.

`launch.py` builds and supervises the vLLM API server (`MarsScheduler`, the Swap
connector, front-end validation of the marsched fields, the marsched config, CPU
defaults) and stops it with every child process; `state.py` adds a read-only
`GET /marsched/state` endpoint (device blocks, host copies, one request's decisions);
`server_tools.py` runs the tool loop of chat requests that name a server-side tool
(`--tools FILE`, read by `tool_config.py`; docs/tools.md).
`tool_parser.py` picks vLLM's tool-call parser from the model when the user names none.
`metrics.py` appends the same state to vLLM's `GET /metrics` in Prometheus form.

`launch` does not import vLLM: the server runs in a child process
(`python -m vllm.entrypoints.launchers.api_server.entry`, vLLM's own entry point,
which does not need the `vllm` console script of a `vllm` distribution).
"""

from marsched.serve.launch import ServeOptions, serve, vllm_command, vllm_environment

__all__ = ["ServeOptions", "serve", "vllm_command", "vllm_environment"]
