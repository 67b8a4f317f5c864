"""`marsched loadgen`: replay multi-turn agent conversations against any OpenAI-compatible server.

One module per concept: `session` (what is replayed), `agent_text` and `claude_code` (the
bundled traces as sessions), `filler` (text of a token count, a growing context),
`arrivals` (Poisson arrivals of sessions), `client` (streamed turns over HTTP), `replay`
(the closed loop of each conversation, Ctrl-C), `records` and `report` (what is measured,
the JSON), `plot`, `options` and `command` (the command line). `reply_target` and
`reply_length` are the bench's reply-length forcing: the key the client sends and the vLLM
logits processor that reads it (the only module here that imports vLLM). docs/loadgen.md
is the manual.
"""
