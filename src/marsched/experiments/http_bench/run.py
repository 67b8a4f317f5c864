"""The comparison as it runs: for each slot of the order, start the configuration's server, replay the
workload with `marsched loadgen`, stop the server's whole process group; after each run, the summary
so far (`summary.json`, `summary.md`).

Files under `out`: `runs/<config>-r<k>/` holds `server.log`, `loadgen.json` (the loadgen report),
`loadgen.log` (its output), `run.json` (`RunRecord`) and, for stock vLLM, `step_costs.json` (its step
meter's cost model); `summary.json` and `summary.md` sit at the top. `loadgen` runs as a subprocess
in its own session, so Ctrl-C reaches only this process, which forwards one SIGINT: loadgen writes
what finished (marked interrupted, left out of the summary), the server is stopped, and the summary
keeps the runs that finished. A server whose core binding differs from the others' stops the
comparison (`binding`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from marsched.atomic import write_atomically
from marsched.experiments.conversations.run import commit, versions
from marsched.experiments.conversations.servers import (START_TIMEOUT_S, Server, cost_model_of, marsched_ranks,
                                                        metered_cost_model, server_counters, tail)
from marsched.experiments.http_bench.binding import BindingMismatch, check_same_binding, core_binding
from marsched.experiments.http_bench.configs import DESCRIPTIONS, ORACLE, Engine, server_command
from marsched.experiments.http_bench.engine_queue import QueueSampler
from marsched.experiments.http_bench.order import Slot, run_order
from marsched.experiments.http_bench.records import RunRecord
from marsched.experiments.http_bench.summary import markdown, summarize
from marsched.loadgen.options import ALL_SESSIONS, CLAUDE_CODE, LoadgenOptions
from marsched.serve.launch import free_port

INTERRUPTED_EXIT = 130
MISMATCH_EXIT = 3
RESUME_MISMATCH_EXIT = 4  # --resume in a folder whose runs had other settings
LOADGEN_STOP_S = 60.0  # for loadgen to write its report after SIGINT
METER_FILE = "step_costs.json"
BINDING_WAIT_S = 5.0  # the binding is logged before the server is healthy; a GPU server has none


@dataclass(frozen=True, slots=True)
class Plan:
    configs: tuple[str, ...]
    repeats: int
    engine: Engine
    load: LoadgenOptions  # its url is a placeholder: each run has its server's
    fixed_s: float  # continuum's T
    out: Path
    start_timeout_s: float = START_TIMEOUT_S
    resume: bool = False  # keep the runs measured earlier in `out` with these settings; run the rest

    def identity(self) -> dict[str, Any]:
        """The settings that make two comparisons' runs interchangeable (`--resume`)."""
        return {"engine": asdict(self.engine), "load": self.load.settings(), "continuum_fixed_s": self.fixed_s}

    def settings(self) -> dict[str, Any]:
        return {"configs": list(self.configs), "repeats": self.repeats,
                "order": [slot.label for slot in run_order(self.configs, self.repeats)],
                **self.identity(),
                "descriptions": {c: DESCRIPTIONS[c] for c in self.configs}, "commit": commit(),
                "versions": versions(), "load_average": list(os.getloadavg()), "cpus": os.cpu_count()}


def progress(message: str) -> None:
    print(f"http_bench: {message}", file=sys.stderr, flush=True)


def loadgen_command(load: LoadgenOptions, url: str, report: Path, config: str = "") -> list[str]:
    """`marsched loadgen` with the plan's workload against `url`, its report to `report`; for the
    oracle diagnostic, with the reply lengths sent as predictions."""
    command = [sys.executable, "-m", "marsched.cli", "loadgen", url, "--workload", load.workload,
               "--rate", repr(load.rate), "--duration", repr(load.duration_s), "--seed", str(load.seed),
               "--gap-scale", repr(load.gap_scale), "--max-turns", str(load.max_turns),
               "--max-tokens", str(load.max_tokens), "--request-timeout", repr(load.request_timeout_s),
               "--out", str(report)]
    if load.max_gap_s is not None:
        command += ["--max-gap-s", repr(load.max_gap_s)]
    if load.workload == CLAUDE_CODE:
        command += ["--token-scale", repr(load.token_scale)]
    if load.turn_chars:
        command += ["--turn-chars", str(load.turn_chars)]
    if load.reply_chars is not None:
        command += ["--reply-chars", str(load.reply_chars)]
    if load.sessions != ALL_SESSIONS:
        command += ["--sessions", load.sessions]
    if not load.conversation_keys:
        command.append("--no-conversation-keys")
    if config == ORACLE:
        command.append("--oracle-predictions")
    return command


def run_loadgen(command: list[str], log: Path) -> int:
    """Run loadgen to its end; on KeyboardInterrupt, SIGINT it, let it write its report, re-raise."""
    with open(log, "w") as output:
        # Its own session: a Ctrl-C in the terminal reaches only us, and loadgen gets exactly one SIGINT.
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return process.wait()
        except KeyboardInterrupt:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=LOADGEN_STOP_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            raise


def _binding(log: Path, wait_s: float) -> str | None:
    deadline = time.monotonic() + wait_s
    while True:
        found = core_binding(log.read_text(errors="replace")) if log.exists() else None
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(0.25)


def run_slot(slot: Slot, plan: Plan, bindings: dict[str, str | None]) -> RunRecord:
    """One run; `bindings` (label -> binding of the runs so far) gains this one's, and BindingMismatch
    stops the comparison. KeyboardInterrupt passes through, after the server is stopped."""
    folder = plan.out / "runs" / slot.label
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port("127.0.0.1")
    meter = folder / METER_FILE  # a stock server's step costs (a marsched server shows its own)
    record = RunRecord(slot.config, slot.repeat, log=str(folder / "server.log"),
                       command=server_command(slot.config, plan.engine, port, plan.fixed_s, meter))
    report = folder / "loadgen.json"
    for earlier in (report, meter):  # left by an earlier comparison in this folder: not this run's
        earlier.unlink(missing_ok=True)
    server = Server(record.command, port, Path(record.log))
    try:
        began = time.monotonic()
        server.wait_healthy(plan.start_timeout_s)
        record.start_s = round(time.monotonic() - began, 1)
        record.binding = _binding(Path(record.log), BINDING_WAIT_S)
        bindings[slot.label] = record.binding
        progress(f"[{slot.label}] healthy after {record.start_s} s; cores: {record.binding or '(none logged)'}")
        check_same_binding(bindings)
        sampler = QueueSampler(server.url).start()
        began = time.monotonic()
        try:
            status = run_loadgen(loadgen_command(plan.load, server.url, report, slot.config), folder / "loadgen.log")
        except KeyboardInterrupt:
            record.interrupted = True
            raise
        finally:
            record.load_s = round(time.monotonic() - began, 1)
            record.queue = sampler.stop().to_dict()
            if report.exists():
                record.loadgen = str(report)
        record.interrupted = status == INTERRUPTED_EXIT
        if status != 0 and not record.interrupted:
            record.error = f"loadgen exited with status {status}: {tail(folder / 'loadgen.log', 3)}"
        elif not report.exists():
            record.error = "loadgen wrote no report"
        ranks = marsched_ranks(server.url)  # once, for both
        record.counters = server_counters(server.url, ranks)
        record.cost_model = cost_model_of(ranks) or metered_cost_model(meter)
        for line in tail(folder / "loadgen.log", 3).splitlines():
            progress(f"[{slot.label}] {line}")
    except RuntimeError as error:  # the server did not start; BindingMismatch goes on up
        if isinstance(error, BindingMismatch):
            raise
        record.error = str(error)
        progress(f"[{slot.label}] failed: {error}")
    finally:
        server.stop()
        (folder / "run.json").write_text(json.dumps(record.to_dict(), indent=1) + "\n")
    return record


def write_summary(plan: Plan, runs: list[RunRecord]) -> str:
    """Write summary.json and summary.md for `runs`; returns the Markdown."""
    summary = summarize(runs, plan.configs, plan.settings())
    text = markdown(summary)
    plan.out.mkdir(parents=True, exist_ok=True)
    write_atomically(plan.out / "summary.json",
                     lambda f: f.write((json.dumps(summary, indent=1, allow_nan=False) + "\n").encode()))
    write_atomically(plan.out / "summary.md", lambda f: f.write((text + "\n").encode()))
    return text


def check_resumable(plan: Plan) -> None:
    """ValueError unless the comparison already in `plan.out` (its summary) had this plan's engine,
    workload and pin: only then are its runs this plan's to keep (`--resume`). Nothing there: fine."""
    summary = plan.out / "summary.json"
    if not summary.exists():
        return
    try:
        earlier = json.loads(summary.read_text())["settings"]
    except (OSError, ValueError, TypeError, KeyError):
        raise ValueError(f"--resume: {summary} is unreadable, so the runs in {plan.out} cannot be checked "
                         "against this comparison's settings; give another --out") from None
    now = json.loads(json.dumps(plan.identity()))  # as written: tuples become lists
    for key, value in now.items():
        if earlier.get(key) != value:
            raise ValueError(f"--resume: the runs in {plan.out} were made with other {key} settings "
                             f"({earlier.get(key)!r}, now {value!r}); give another --out")


def earlier_run(plan: Plan, slot: Slot) -> RunRecord | None:
    """The slot's run measured by an earlier comparison in `plan.out` (`check_resumable`), to keep;
    None when there is none to keep (never run, cut off, not measured, its report gone)."""
    try:
        run = RunRecord.from_dict(json.loads((plan.out / "runs" / slot.label / "run.json").read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not run.measured or not Path(run.loadgen).is_file():
        return None
    return run


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_plan(plan: Plan, run: Callable[[Slot, Plan, dict[str, str | None]], RunRecord] = run_slot) -> int:
    """Every slot of the plan's order; the exit status (0: every run measured, 1: some did not,
    3: the core bindings differ, 4: `--resume` found runs of other settings, 130: interrupted). With
    `plan.resume`, a slot measured earlier in `plan.out` is kept, not run again."""
    order = run_order(plan.configs, plan.repeats)
    runs: list[RunRecord] = []
    bindings: dict[str, str | None] = {}
    status = 0
    if plan.resume:
        try:
            check_resumable(plan)
        except ValueError as error:
            progress(f"STOPPED: {error}")
            return RESUME_MISMATCH_EXIT
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops like Ctrl-C: the server is stopped
    # A shell starts background jobs with SIGINT ignored; Ctrl-C (or kill -INT) must still stop the run.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for number, slot in enumerate(order, start=1):
            kept = earlier_run(plan, slot) if plan.resume else None
            if kept is not None:
                progress(f"[{slot.label}] run {number} of {len(order)}: kept, measured earlier in {plan.out}")
                bindings[slot.label] = kept.binding
                check_same_binding(bindings)
                runs.append(kept)
                continue
            progress(f"[{slot.label}] run {number} of {len(order)}: {DESCRIPTIONS[slot.config]}")
            runs.append(run(slot, plan, bindings))
            write_summary(plan, runs)
    except BindingMismatch as error:
        progress(f"STOPPED: {error}")
        status = MISMATCH_EXIT
    except KeyboardInterrupt:
        progress("interrupted; the server was stopped, the summary keeps the runs that finished")
        status = INTERRUPTED_EXIT
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    text = write_summary(plan, runs)
    print(text, flush=True)
    progress(f"summary: {plan.out / 'summary.json'}, {plan.out / 'summary.md'}")
    if status == 0 and not all(run.measured for run in runs):
        status = 1
    return status
