"""The learned length predictor (`--predictor learned[:DIR]`) and its fallback rule (`type-mean`).

`LearnedModel` is the encoder and a trained head (`marsched predictor train`); the default
head ships in the package (`marsched/predict/heads/default`), and so does one trained on
agent turns (`heads/agent`, `learned:agent`; `marsched.predict.agent_examples`). It predicts
from text: the newest turn, the context's length in tokens and the length of the model's
previous reply (segment) in the conversation, which is known when the segment starts.

In the simulator (`LearnedLength`), a trace's text records (the INFERCEPT chatbot, TTS and
image families, `marsched.predict.texts`) get learned predictions, made once per trace
before the run. Each segment's prediction reads the previous segment's true length, which
is known when that segment starts; MARS also ranks by the predicted segments after the
current one, and for those the previous length is not known yet at ranking time, so those
predictions are slightly better informed than a live system's. Records without text (the token-count records: math, QA, VE; our JSONL
traces) fall back to `TypeMeanLength`: the mean output length, over the trace's segments, of
the segments that end the same way (with a call of the same API type, or with the end of
the request). It is an aggregate of the trace, not the segment's own length, and it is the
`type-mean` predictor on its own.

In the vLLM plugin the prediction is made in the front end (`marsched.vllm.runtime`), from
the prompt's text, and reaches the scheduler in the request's metadata.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib.resources import as_file, files

import numpy as np

from marsched.predict.encoder import Encoder
from marsched.predict.head import HEAD_FILE, Head, load_head
from marsched.workload.model import Request

DEFAULT = "default"


def default_head_dir() -> str:
    """The head shipped in the package."""
    with as_file(files("marsched.predict") / "heads" / DEFAULT) as path:
        return str(path)


@dataclass(frozen=True)
class LearnedModel:
    head: Head
    encoder: Encoder
    directory: str

    def predict(self, texts: Sequence[str], context_tokens: Sequence[int],
                previous_tokens: Sequence[int] | None = None) -> np.ndarray:
        """Predicted output tokens (integers, at least 1) for each text, given its context's length
        and the length of the model's previous reply (segment) in the conversation (0: none)."""
        if not texts:
            return np.zeros(0, dtype=np.int64)
        features = self.encoder.encode(texts, context_tokens, previous_tokens)
        return np.rint(self.head.predict(features)).astype(np.int64)

    def predict_one(self, text: str, context_tokens: int, previous_tokens: int = 0) -> int:
        return int(self.predict([text], [context_tokens], [previous_tokens])[0])


@cache
def load_model(directory: str | None = None) -> LearnedModel:
    """The trained head in `directory` (None: the packaged default) with its encoder; loaded once per process.

    Raises ValueError naming the directory if there is no head there. The encoder's weights are
    read on first use (`LearnedModel.encoder.load()` to pay for it up front).
    """
    directory = directory or default_head_dir()
    head = load_head(directory)
    encoder = Encoder(head.meta.get("encoder", "embed"), int(head.meta.get("max_tokens", 128)),
                      bool(head.meta.get("previous_feature", False)))
    return LearnedModel(head, encoder, directory)


def segment_kind(request: Request, segment_index: int) -> str:
    """What the type-mean rule groups by: the API type of the segment's call, or "end"."""
    api = request.segments[segment_index].api
    return api.api_type.value if api is not None else "end"


@dataclass
class TypeMeanLength:
    """Per segment kind (`segment_kind`), the mean output length over a trace's segments.

    Built from the trace (`prepare`) before a run; a kind the trace does not have gets the
    mean over all its segments.
    """

    name: str = "type-mean"
    means: dict[str, int] = field(default_factory=dict)
    overall: int = 0

    def prepare(self, templates: Sequence[Request], trace: str | None = None) -> None:
        totals: dict[str, list[int]] = defaultdict(list)
        for request in templates:
            for index, segment in enumerate(request.segments):
                totals[segment_kind(request, index)].append(segment.output_tokens)
        if not totals:
            raise ValueError("type-mean predictor: the trace has no segments")
        self.means = {kind: max(1, round(float(np.mean(v)))) for kind, v in totals.items()}
        self.overall = max(1, round(float(np.mean([x for v in totals.values() for x in v]))))

    def predict(self, request: Request, segment_index: int) -> int:
        if not self.overall:
            raise RuntimeError("type-mean predictor: prepare(templates) was not called")
        return self.means.get(segment_kind(request, segment_index), self.overall)


@dataclass
class LearnedLength:
    """Learned predictions for a trace's text records, `TypeMeanLength` for the rest."""

    directory: str | None = None  # None: the packaged head
    fallback: TypeMeanLength = field(default_factory=TypeMeanLength)
    table: dict[str, tuple[int, ...]] = field(default_factory=dict)  # request id -> per segment

    def __post_init__(self) -> None:
        load_model(self.directory)  # a missing or broken head fails here, before any run

    @property
    def name(self) -> str:
        return "learned" if self.directory is None else f"learned:{self.directory}"

    def prepare(self, templates: Sequence[Request], trace: str | None = None) -> None:
        self.fallback.prepare(templates)
        self.table = dict(_trace_table(self.directory, str(trace))) if trace is not None else {}

    def predict(self, request: Request, segment_index: int) -> int:
        predicted = self.table.get(request.template_id or request.request_id)
        if predicted is not None and segment_index < len(predicted):
            return predicted[segment_index]
        return self.fallback.predict(request, segment_index)

    @property
    def learned_share(self) -> int:
        """How many of the trace's requests have learned predictions."""
        return len(self.table)


@dataclass(frozen=True, slots=True)
class FrontEndLength:
    """The learned predictor inside the vLLM scheduler: the plan's lengths.

    The engine core never runs the encoder. The front end predicts from the text and sends the
    prediction with each input chunk (`marsched.vllm.metadata`, ``predicted``); the scheduler puts
    it into the request's plan, and this reads the plan. A chunk without a prediction (a client
    that sends none) keeps the plan's own length (for plain clients, `max_tokens`).
    """

    name: str = "learned"

    def predict(self, request: Request, segment_index: int) -> int:
        return request.segments[segment_index].output_tokens


@cache
def _trace_table(directory: str | None, trace: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Learned predictions for every text segment of a trace, once per process (runs share it)."""
    from marsched.predict.texts import text_segments

    model = load_model(directory)
    segments = text_segments(trace)
    flat = [(rid, step) for rid, steps in segments.items() for step in steps]
    predicted = iter(model.predict([s.last_turn for _, s in flat], [s.context_tokens for _, s in flat],
                                   [s.previous_output_tokens for _, s in flat]).tolist())
    return tuple((rid, tuple(next(predicted) for _ in steps)) for rid, steps in segments.items())


def packaged_head_dir(name: str) -> str | None:
    """The directory of the head `name` shipped in the package (``heads/NAME``), or None if there is none."""
    if not name or name != os.path.basename(name) or name in (".", ".."):
        return None
    with as_file(files("marsched.predict") / "heads" / name) as path:
        return str(path) if os.path.isfile(os.path.join(path, HEAD_FILE)) else None


def head_directory(spec: str) -> str | None:
    """`learned` -> None (the packaged default head); `learned:NAME` -> a packaged head (``heads/NAME``:
    ``agent``, trained on agent turns); `learned:DIR` -> DIR (ValueError if empty).

    A bare name is a packaged head's before a directory's: write ``./agent`` for a directory of that name.
    """
    if spec == "learned":
        return None
    directory = spec.removeprefix("learned:")
    if not directory:
        raise ValueError("predictor 'learned:': DIR is empty (use 'learned' for the packaged head)")
    return packaged_head_dir(directory) or os.path.abspath(directory)
