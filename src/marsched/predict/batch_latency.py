"""Wall and CPU time of one batched prediction (`marsched predictor bench`): what a serving front end pays.

A server that batches its concurrent requests' predictions calls `LearnedModel.predict` once
per batch. This times that call on agent turns (`agent_examples`: their newest text, of which
the encoder reads the first 4,000 characters, their context and previous-reply lengths),
`batches` batches of `batch` turns drawn with a seed, after one warm-up batch. The wall time
includes waiting for a core on a shared machine; the CPU time is the whole process's (the
`tokenizers` library encodes a batch on its own threads unless ``TOKENIZERS_PARALLELISM=false``).
The load average (``/proc/loadavg``) is read before and after.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence

import numpy as np

from marsched.predict.encoder import MAX_CHARS
from marsched.predict.examples import Example
from marsched.predict.learned import LearnedModel


def load_average() -> tuple[float, float, float]:
    with open("/proc/loadavg") as handle:
        one, five, fifteen = (float(v) for v in handle.read().split()[:3])
    return one, five, fifteen


def batch_latency(model: LearnedModel, examples: Sequence[Example], batch: int = 64, batches: int = 200,
                  seed: int = 0) -> dict:
    """p50/p99/max of the wall and CPU milliseconds per batch of `batch` predictions."""
    if batch < 1 or batches < 1 or not examples:
        raise ValueError("batch_latency: need batch >= 1, batches >= 1 and some examples")
    rng = random.Random(seed)
    draws = [[examples[rng.randrange(len(examples))] for _ in range(batch)] for _ in range(batches + 1)]
    model.encoder.load()
    before = load_average()
    wall, cpu = [], []
    for index, drawn in enumerate(draws):
        args = ([e.last_turn for e in drawn], [e.context_tokens for e in drawn],
                [e.previous_output_tokens for e in drawn])
        t, c = time.perf_counter(), time.process_time()
        model.predict(*args)
        if index:  # the first batch warms up
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    after = load_average()
    wall_ms, cpu_ms = np.array(wall) * 1e3, np.array(cpu) * 1e3
    texts = [len(e.last_turn) for drawn in draws[1:] for e in drawn]

    def stats(values: np.ndarray, prefix: str) -> dict:
        return {f"{prefix}_p50_ms": round(float(np.percentile(values, 50)), 2),
                f"{prefix}_p99_ms": round(float(np.percentile(values, 99)), 2),
                f"{prefix}_max_ms": round(float(values.max()), 2)}

    return {"directory": model.directory, "encoder": model.encoder.kind, "head": model.head.kind,
            "batch": batch, "batches": batches,
            "mean_text_chars": round(float(np.mean(texts)), 1),
            "mean_chars_read": round(float(np.mean(np.minimum(texts, MAX_CHARS))), 1),  # the encoder's cut
            **stats(wall_ms, "wall"), **stats(cpu_ms, "cpu"),
            "requests_per_s": round(batch * batches / float(np.sum(wall)), 1),
            "load_average_before": before, "load_average_after": after, "cpus": os.cpu_count(),
            "omp_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
            "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM", "unset")}
