"""`marsched serve`'s command line and environment, without starting vLLM (tests/test_serve.py runs it)."""

import json
import subprocess
import sys

import pytest

from marsched.serve.launch import (
    AFFINITY_MIDDLEWARE, ENTRY, METRICS_MIDDLEWARE, PREDICTION_MIDDLEWARE, SCHEDULER_CLS, STATE_MIDDLEWARE,
    STOP_MARKS_MIDDLEWARE, TOOL_GAPS_MIDDLEWARE, VALIDATOR,
    ServeOptions,
    vllm_command, vllm_environment,
)
from marsched.vllm.config import MarsConfig


def test_the_command_configures_mars_and_passes_the_rest_to_vllm():
    options = ServeOptions("m", MarsConfig(policy="infercept", trace_path="/tmp/t.jsonl"), port=9000,
                           vllm_args=("--max-model-len", "512", "--logits-processors", "a:B", "c:D", "--enforce-eager"))
    command = vllm_command(options, python="py")
    assert command[:3] == ["py", "-m", ENTRY]
    assert command[command.index("--model") + 1] == "m" and command[command.index("--port") + 1] == "9000"
    assert command[command.index("--scheduler-cls") + 1] == SCHEDULER_CLS
    config = json.loads(command[command.index("--additional-config") + 1])["marsched"]
    assert config["policy"] == "infercept" and config["trace_path"] == "/tmp/t.jsonl"
    assert json.loads(command[command.index("--kv-transfer-config") + 1])["kv_connector"] == "HostSwapConnector"
    processors = command.index("--logits-processors")
    assert command[processors + 1:processors + 4] == [VALIDATOR, "a:B", "c:D"]  # the user's are added to ours
    assert command.count("--logits-processors") == 1
    middlewares = [command[i + 1] for i, arg in enumerate(command) if arg == "--middleware"]
    assert middlewares == [STOP_MARKS_MIDDLEWARE, TOOL_GAPS_MIDDLEWARE, AFFINITY_MIDDLEWARE, PREDICTION_MIDDLEWARE,
                           STATE_MIDDLEWARE, METRICS_MIDDLEWARE]
    assert command[-3:] == ["--max-model-len", "512", "--enforce-eager"]  # after ours: they may override


def test_switches_leave_parts_out():
    command = vllm_command(ServeOptions("m", swap=False, validate=False, state_endpoint=False))
    assert "--kv-transfer-config" not in command and "--logits-processors" not in command
    assert [command[i + 1] for i, arg in enumerate(command) if arg == "--middleware"] == [
        STOP_MARKS_MIDDLEWARE, TOOL_GAPS_MIDDLEWARE, AFFINITY_MIDDLEWARE, PREDICTION_MIDDLEWARE]


def test_data_parallel_gets_one_api_server_and_the_placement_unless_given():
    """vLLM starts one API server per rank by default; one process must know every conversation's rank."""
    assert "--api-server-count" not in vllm_command(ServeOptions("m"))
    command = vllm_command(ServeOptions("m", vllm_args=("--data-parallel-size", "2")))
    assert command[command.index("--api-server-count") + 1] == "1"
    assert "--api-server-count" in vllm_command(ServeOptions("m", vllm_args=("--data-parallel-size=2",)))
    assert "--api-server-count" not in vllm_command(ServeOptions("m", vllm_args=("-dp", "1")))
    given = vllm_command(ServeOptions("m", vllm_args=("-dp", "2", "--api-server-count", "2")))
    assert given.count("--api-server-count") == 1 and given[-1] == "2"
    assert vllm_environment(ServeOptions("m"), environ={})["MARSCHED_DP_PLACEMENT"] == "least-loaded"
    assert vllm_environment(ServeOptions("m", dp_placement="hash"), environ={})["MARSCHED_DP_PLACEMENT"] == "hash"
    with pytest.raises(ValueError, match="--dp-placement 'nearest': give one of mars, least-loaded, hash, off"):
        ServeOptions("m", dp_placement="nearest").check()


@pytest.mark.parametrize("args,message", [
    (("--scheduler-cls", "x"), "--scheduler-cls is set by marsched serve"),
    (("--additional-config={}",), "--additional-config is set by marsched serve"),
    (("--kv-transfer-config", "{}"), "add --no-swap"),
    (("--worker-extension-cls", "x"), "--worker-extension-cls is set by marsched serve"),
])
def test_options_marsched_sets_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        ServeOptions("m", vllm_args=args).check()


def test_cpu_environment_defaults_and_flags():
    env = vllm_environment(ServeOptions("m"), environ={})
    assert 1 <= int(env["VLLM_CPU_KVCACHE_SPACE"]) <= 32
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # vLLM's own default
    assert vllm_environment(ServeOptions("m"), environ={"VLLM_CPU_KVCACHE_SPACE": "7"})["VLLM_CPU_KVCACHE_SPACE"] == "7"
    env = vllm_environment(ServeOptions("m", cpu_kv_cache_gib=3, cpu_threads_bind="0-1", cpu_reserved_cores=1),
                           environ={"VLLM_CPU_KVCACHE_SPACE": "7"})
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_NUM_OF_RESERVED_CPU"]) == \
        ("3", "0-1", "1")


def test_reserved_cores_are_stock_vllms_unless_given():
    """With a KV connector vLLM reserves a core more; serve reserves what stock vLLM does."""
    assert vllm_environment(ServeOptions("m"), environ={})["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    env = vllm_environment(ServeOptions("m", vllm_args=("-tp", "2", "--pipeline-parallel-size=2")), environ={})
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "4"
    assert vllm_environment(ServeOptions("m"), environ={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
                            )["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"  # the user's
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in vllm_environment(ServeOptions("m", swap=False), environ={})


def test_the_cli_imports_without_vllm_and_serve_says_what_to_install():
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import marsched.cli, marsched.serve\n"
            "sys.argv = ['marsched', 'serve', 'MODEL']\n"
            "marsched.cli.app()\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "marsched serve needs vLLM: pip install 'marsched[vllm]'" in " ".join(run.stderr.split())


def test_serve_option_errors_name_their_flag(monkeypatch):
    import marsched.serve as serve_package
    from typer.testing import CliRunner

    from marsched.cli import app

    def started(options, echo):
        raise AssertionError(f"marsched serve started with {options}")

    monkeypatch.setattr(serve_package, "serve", started)  # in this process, a check that passes must not start vLLM
    for args, expected in ((("--policy", "fifo"), "--policy fifo: unknown policy"),
                           (("--port", "70000"), "--port 70000: give 0 (a free port) to 65535"),
                           (("--seconds-per-token", "0"), "--seconds-per-token 0: give a finite number > 0"),
                           (("--cpu-kv-cache-gib", "0"), "--cpu-kv-cache-gib 0: give a whole number of GiB >= 1"),
                           (("--retention", "always"), "--retention always --retention-limit-s 60: retention 'always'"),
                           (("--retention", "fixed:0"), "fixed:SECONDS needs a number of seconds > 0"),
                           (("--retention-limit-s", "0"), "retention limit must be > 0 s"),
                           (("--dp-placement", "near"), "--dp-placement 'near': give one of mars")):
        run = CliRunner().invoke(app, ["serve", "MODEL", *args])
        assert run.exit_code == 2 and expected in " ".join(run.stderr.split()), (args, run.output)


# A stand-in for vLLM's API server: healthy on --port, then it exits 0 on its own, as vLLM's
# server does when its engine core dies.
_DYING_SERVER = """
import http.server, sys, threading, time
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
time.sleep(1.5)
sys.exit(0)
"""


def test_serve_exits_non_zero_when_vllm_exits_on_its_own(tmp_path):
    from marsched.serve.launch import serve

    python = tmp_path / "python"  # serve runs `python -m vllm.entrypoints...`: this ignores the -m
    python.write_text(f"#!{sys.executable}\n" + _DYING_SERVER)
    python.chmod(0o755)
    said: list[str] = []
    status = serve(ServeOptions(model="m", port=0, state_endpoint=False, swap=False), echo=said.append,
                   python=str(python), grace_s=5)
    assert status == 1
    assert any("listening on" in line for line in said)  # it was ready first
    assert "exited on its own with status 0" in said[-1]


def test_vllms_shutdown_timeout_is_ours_unless_given():
    from marsched.serve.launch import SHUTDOWN_TIMEOUT_S

    command = vllm_command(ServeOptions("m"))
    assert command[command.index("--shutdown-timeout") + 1] == str(SHUTDOWN_TIMEOUT_S)
    for given in (("--shutdown-timeout", "3"), ("--shutdown-timeout=3",)):
        command = vllm_command(ServeOptions("m", vllm_args=given))
        assert [a for a in command if a.startswith("--shutdown-timeout")] == [given[0]]
        assert command[-len(given):] == list(given)


# A server that stops its own child on SIGTERM, as vLLM's API server stops its engine core: the
# child counts the SIGTERMs it receives, and exits on the one from its parent.
_CHILD = """
import os, signal, sys, time
folder = sys.argv[1]
def on_term(signum, frame):
    with open(os.path.join(folder, "child.log"), "a") as log:
        log.write("TERM;")
signal.signal(signal.SIGTERM, on_term)
open(os.path.join(folder, "child.ready"), "w").close()
while not os.path.exists(os.path.join(folder, "parent.stopping")):
    time.sleep(0.02)
time.sleep(0.5)  # a second SIGTERM from elsewhere would arrive by now
"""
_PARENT = """
import os, signal, subprocess, sys, time
folder = sys.argv[1]
child = subprocess.Popen([sys.executable, os.path.join(folder, "child.py"), folder])
def on_term(signum, frame):
    open(os.path.join(folder, "parent.stopping"), "w").close()
    child.send_signal(signal.SIGTERM)
    child.wait()
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
while True:
    time.sleep(0.05)
"""


def test_stopping_signals_the_server_alone_so_that_its_children_stop_in_order(tmp_path):
    """A SIGTERM to the whole group reached vLLM's engine core twice; the second, during its
    teardown, killed it before the trace's `end` was written."""
    import time

    from marsched.serve.launch import stop_process_group

    (tmp_path / "child.py").write_text(_CHILD)
    (tmp_path / "parent.py").write_text(_PARENT)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), str(tmp_path)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "child.ready").exists():
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.05)
    assert stop_process_group(parent, grace_s=20) == 0
    assert (tmp_path / "child.log").read_text() == "TERM;"  # one SIGTERM, its parent's
