"""Per-request records, summaries and the event trace."""

from marsched.metrics.records import RequestRecord, summarize
from marsched.metrics.trace import EventTrace, TraceFile, read_trace

__all__ = ["EventTrace", "RequestRecord", "TraceFile", "read_trace", "summarize"]
