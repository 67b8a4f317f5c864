"""Commands the tests run as a user does, each in processes of its own, started in the background.

A command such as `marsched bench` starts a vLLM engine (an engine-core process that imports
vLLM) and takes tens of seconds, mostly one core's work, while its test
only reads what it wrote. So the session runs them as shared things (`shared.SharedPool`), one
after the other in a background thread of their own, from the session's start, while the other
tests run; conftest.py moves the tests that read them to the end of the session.

A command is one or more steps (argument lists) run in order in a folder of its own; a step that
fails ends the command. Each step runs in its own process group, and what it left alive there
once it returned is noted (`Step.left_behind`), then killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Step:
    args: list[str]
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    left_behind: list[str] = field(default_factory=list)  # `ps` lines of its group still alive after it returned
    seconds: float = 0.0


@dataclass(frozen=True)
class CommandConfig:
    name: str  # the session fixture that hands it out (conftest.py)
    steps: Callable[[str, Path], list[list[str]]]  # from (the tiny model, the command's folder)
    timeout_s: float = 540.0  # all steps together
    # From the session's environment; by default the commands start engine-core processes of
    # their own, as a user's do.
    env: Callable[[dict[str, str]], dict[str, str]] = field(default=lambda env: _user_env(env))

    def __call__(self, model: str, folder: Path) -> "Command":
        """The command of this configuration, starting in `folder` (`shared.SharedPool`'s factory)."""
        return Command(self, self.steps(model, folder), folder)


class Command:
    def __init__(self, config: CommandConfig, steps: list[list[str]], folder: Path) -> None:
        self.config, self.folder = config, folder
        self.steps = [Step(args) for args in steps]
        self._process: subprocess.Popen | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"command-{config.name}", daemon=True)
        self._thread.start()

    @property
    def last(self) -> Step:
        return self.steps[-1]

    def _run(self) -> None:
        env = self.config.env(dict(os.environ))
        deadline = time.monotonic() + self.config.timeout_s
        for step in self.steps:
            with self._lock:
                if self._stopped:
                    return
                self._process = subprocess.Popen(step.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                 text=True, env=env, cwd=ROOT, start_new_session=True)
            began = time.monotonic()
            try:
                step.stdout, step.stderr = self._process.communicate(timeout=max(1.0, deadline - began))
            except subprocess.TimeoutExpired:
                step.stderr = f"timed out after {self.config.timeout_s:.0f} s"
            finally:
                step.seconds = time.monotonic() - began
                step.left_behind = _alive_in_group(self._process.pid)
                _kill_group(self._process)
                step.returncode = self._process.poll()
            if step.returncode != 0:
                return

    def wait_ready(self) -> None:
        """Wait for the command to end (the timeout is the command's own); its steps say how it went."""
        self._thread.join()

    def close(self) -> None:
        with self._lock:
            self._stopped = True
            if self._process is not None:
                _kill_group(self._process)
        self._thread.join(30)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _alive_in_group(group: int, grace_s: float = 10.0) -> list[str]:
    """The group's processes still alive `grace_s` after its command returned.

    Exited children wait as zombies for a parent that reaps them (in a container, maybe never):
    not alive. A child may still be on its way out when the command returns (state R, its
    arguments already gone, on a loaded machine): it gets the grace period.
    """
    deadline = time.monotonic() + grace_s
    while True:
        listing = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(group)], capture_output=True,
                                 text=True).stdout
        alive = [line for line in listing.splitlines() if line.split()[1:2] != ["Z"]]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _user_env(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}


def marsched(*args: str) -> list[str]:
    return [sys.executable, "-m", "marsched.cli", *args]


# --- the commands ------------------------------------------------------------------------------

# `marsched model` then `marsched bench` (test_bench_smoke.py): a tiny model of its own, built as a
# user builds one, six requests of the single-API trace, stock vLLM and MARS one after the other.
BENCH_TINY = ("--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--intermediate", "256",
              "--vocab", "512", "--max-position", "1024")
BENCH_KV_GB = 0.01
BENCH_POLICIES = ("vllm", "mars")
BENCH = CommandConfig(
    "bench_run",
    lambda model, folder: [
        marsched("model", "--out", str(folder / "model"), *BENCH_TINY),
        marsched("bench", "--model", str(folder / "model"), "--trace", "single", "--policies", ",".join(BENCH_POLICIES),
                 "--qps", "4", "--duration", "5", "--max-requests", "6", "--api-time-scale", "0.01",
                 "--token-scale", "0.1", "--kv-cache-gb", str(BENCH_KV_GB), "--json", str(folder / "bench.json"))],
    env=lambda env: {**_user_env(env), "VLLM_CPU_KVCACHE_SPACE": "1"},
)

# The HTTP comparison, both kinds of server, one short repeat (test_http_bench.py).
HTTP_BENCH = CommandConfig(
    "http_bench_run",
    lambda model, folder: [[sys.executable, "-m", "marsched.experiments.http_bench", "--model", model,
                            "--out", str(folder / "http"), "--configs", "vllm-stock,mars", "--repeats", "1",
                            "--rate", "0.5", "--duration", "6", "--max-turns", "3", "--turn-chars", "100",
                            "--max-gap-s", "1"]],
    env=lambda env: env,
)

# The live twin, one configuration at one load for a few seconds (test_twin.py): the CI smoke.
TWIN = CommandConfig(
    "twin_run",
    lambda model, folder: [[sys.executable, "-m", "marsched.experiments.twin", "--model", model,
                            "--profile", str(ROOT / "results" / "twin" / "profile.json"), "--out", str(folder / "twin"),
                            "--configs", "mars", "--loads", "smoke:1", "--repeats", "1", "--duration", "4",
                            "--max-turns", "2", "--token-scale", "0.002", "--gap-scale", "0.01", "--max-gap-s", "0.5",
                            "--kv-blocks", "33", "--max-model-len", "4096",
                            f"--marsched-arg=--trace-out={folder / 'trace.jsonl'}"]],
    env=lambda env: env,
)

# The scheduler-overhead benchmark with the connector, five steps at 20 waiting (test_overhead_bench.py).
OVERHEAD = CommandConfig(
    "overhead_run",
    lambda model, folder: [[sys.executable, str(ROOT / "scripts" / "bench_scheduler_overhead.py"), "--model", model,
                            "--sizes", "20", "--steps", "5", "--warmup", "0", "--repeats", "1", "--policies", "mars",
                            "--connector", "on", "--json", str(folder / "overhead.json")]],
    timeout_s=280.0,
    env=lambda env: env,
)

# The lifecycle parity stream on real vLLM, one engine per policy (test_lifecycle_parity.py); the
# engines in the command's process, as the suite's in-process ones.
PARITY = CommandConfig(
    "parity_run",
    lambda model, folder: [[sys.executable, str(ROOT / "tests" / "lifecycle_parity_run.py"), model,
                            str(folder / "traces")]],
    timeout_s=600.0,
    env=lambda env: env,
)

# `marsched calibrate --fast` as a user runs it (test_calibrate_vllm.py).
CALIBRATE_KV_GB = 0.02
CALIBRATE = CommandConfig(
    "calibrate_run",
    lambda model, folder: [marsched("calibrate", "--model", model, "--out", str(folder / "calibrated.json"), "--fast",
                                    "--kv-cache-gb", str(CALIBRATE_KV_GB))],
    timeout_s=380.0,
)

SHARED = {config.name: config for config in (BENCH, HTTP_BENCH, TWIN, OVERHEAD, PARITY, CALIBRATE)}
