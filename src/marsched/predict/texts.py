"""The text a server would see at each segment of a trace's text records.

The request model (`marsched.workload.model`) keeps token counts only; a learned predictor
needs the words. This reads them from the same trace file, beside the loader: for each text
record of an INFERCEPT/MARS JSON trace (the chatbot, TTS and image families), per segment, the
record's first prompt, the newest turn (segment 0: the prompt; later: the previous call's
return, the user's next turn or the TTS/image instruction), the counts the loader gives and
the previous segment's output length.
Token-count records and our JSONL format carry no text and give nothing here.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from functools import cache

from marsched.workload.loader import load_trace, named_trace


@dataclass(frozen=True, slots=True)
class TextSegment:
    prompt: str  # the record's first prompt (the same for every segment of a record)
    last_turn: str
    last_turn_tokens: int
    context_tokens: int
    output_tokens: int
    api_type: str  # the call that ends the segment, or "end"
    previous_output_tokens: int  # the previous segment's completion (known when this one starts); 0 for the first


def text_segments(trace: str | os.PathLike[str]) -> dict[str, tuple[TextSegment, ...]]:
    """Request id -> its segments' text, for every text record of the trace (a name or a path)."""
    return dict(_text_segments(str(trace)))


@cache
def _text_segments(trace: str) -> tuple[tuple[str, tuple[TextSegment, ...]], ...]:
    named = named_trace(trace)
    if named is not None:
        if not named.file.endswith(".json"):
            return ()
        raw = named.resource().read_bytes()
    elif trace.lower().endswith(".json"):
        with open(trace, "rb") as handle:
            raw = handle.read()
    else:
        return ()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loader's warnings are the trace loader's to give
        requests = {request.request_id: request for request in load_trace(trace)}
    document = json.loads(raw)
    out = []
    for request_id, segments in document.items():
        if not segments or "prompt" not in segments[0] or request_id not in requests:
            continue
        request = requests[request_id]
        first = segments[0]["prompt"]
        steps = []
        last_turn, last_turn_tokens, previous = first, request.prompt_tokens, 0
        for index, segment in enumerate(request.segments):
            api_type = segment.api.api_type.value if segment.api else "end"
            steps.append(TextSegment(first, last_turn, last_turn_tokens, segment.context_tokens,
                                     segment.output_tokens, api_type, previous))
            previous = segment.output_tokens
            last_turn = segments[index].get("api_token", "") if index < len(segments) else ""
            last_turn_tokens = segment.api.return_tokens if segment.api else 0
        out.append((request_id, tuple(steps)))
    return tuple(out)
