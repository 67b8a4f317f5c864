"""Requests, trace loaders, arrival processes and synthetic mixes."""

from marsched.workload.agent import AgentWorkloadParams, agent_requests
from marsched.workload.arrivals import poisson_arrivals
from marsched.workload.claude_code import load_claude_code, parse_claude_code
from marsched.workload.errors import TraceError, TraceWarning
from marsched.workload.infercept_json import (
    api_type_for_duration,
    api_type_for_id,
    api_type_for_text_call,
    load_infercept_json,
    parse_infercept_json,
)
from marsched.workload.jsonl import load_jsonl, parse_jsonl, request_to_record, save_jsonl
from marsched.workload.loader import (
    NAMED_TRACES,
    TRACE_NAMES,
    NamedTrace,
    bundled_trace,
    load_bundled,
    load_named,
    load_trace,
    named_trace,
)
from marsched.workload.model import ApiCall, ApiType, Request, Segment, Spawn, build_request
from marsched.workload.synthetic import DEFAULT_PROFILES, DEFAULT_PROMPT_TOKENS, ApiTypeProfile, synthetic_requests
from marsched.workload.token_scale import scale_tokens
from marsched.workload.tokenizer import count_tokens, count_tokens_batch

__all__ = [
    "DEFAULT_PROFILES",
    "DEFAULT_PROMPT_TOKENS",
    "NAMED_TRACES",
    "TRACE_NAMES",
    "AgentWorkloadParams",
    "ApiCall",
    "ApiType",
    "ApiTypeProfile",
    "NamedTrace",
    "Request",
    "Segment",
    "Spawn",
    "TraceError",
    "TraceWarning",
    "agent_requests",
    "api_type_for_duration",
    "api_type_for_id",
    "api_type_for_text_call",
    "build_request",
    "bundled_trace",
    "count_tokens",
    "count_tokens_batch",
    "load_bundled",
    "load_claude_code",
    "load_infercept_json",
    "load_jsonl",
    "load_named",
    "load_trace",
    "named_trace",
    "parse_claude_code",
    "parse_infercept_json",
    "parse_jsonl",
    "poisson_arrivals",
    "request_to_record",
    "save_jsonl",
    "scale_tokens",
    "synthetic_requests",
]
