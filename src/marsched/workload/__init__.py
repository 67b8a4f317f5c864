"""Requests, trace loaders, arrival processes and synthetic mixes."""

from marsched.workload.arrivals import poisson_arrivals
from marsched.workload.errors import TraceError
from marsched.workload.infercept_json import (
    api_type_for_duration,
    api_type_for_id,
    load_infercept_json,
    parse_infercept_json,
)
from marsched.workload.jsonl import load_jsonl, parse_jsonl, request_to_record, save_jsonl
from marsched.workload.loader import BUNDLED_NAMES, bundled_trace, load_bundled, load_trace
from marsched.workload.model import ApiCall, ApiType, Request, Segment, build_request
from marsched.workload.synthetic import DEFAULT_PROFILES, DEFAULT_PROMPT_TOKENS, ApiTypeProfile, synthetic_requests
from marsched.workload.tokenizer import count_tokens, count_tokens_batch

__all__ = [
    "BUNDLED_NAMES",
    "DEFAULT_PROFILES",
    "DEFAULT_PROMPT_TOKENS",
    "ApiCall",
    "ApiType",
    "ApiTypeProfile",
    "Request",
    "Segment",
    "TraceError",
    "api_type_for_duration",
    "api_type_for_id",
    "build_request",
    "bundled_trace",
    "count_tokens",
    "count_tokens_batch",
    "load_bundled",
    "load_infercept_json",
    "load_jsonl",
    "load_trace",
    "parse_infercept_json",
    "parse_jsonl",
    "poisson_arrivals",
    "request_to_record",
    "save_jsonl",
    "synthetic_requests",
]
