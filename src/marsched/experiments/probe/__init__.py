"""The probe: a population of clients that misbehave as real ones do, against a live server.

- `fields`: OpenAI request fields, valid and not, drawn at random, and what a fair answer is;
- `tools`: server-side tools that work, sleep, raise, hang and return garbage;
- `actions`: what one client does (conversations, abandoned and released ones, disconnects,
  malformed and oversized requests, fuzzed fields, server tools);
- `load`: many clients at once, and a summary of what they saw;
- `run`: the soak, stock vLLM against `marsched serve` (`python -m marsched.experiments.probe`).
"""
