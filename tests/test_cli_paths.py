"""The CLI's output paths, messages and table, as a user meets them (real files, real subprocesses).

Output paths (`--json`, `--plot`, `--trace-out`) are checked before any work; a symlink is
written through; a special file (/dev/null, /dev/full, /dev/stdout) is written directly and
never replaced. Every error names its flag. The results table keeps the `--policies` order
and is never cut at 80 columns.
"""

import json
import os
import pty
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from marsched.atomic import AtomicFile, OutputPathError, check_output_path, write_atomically


def marsched(*args, cwd=None, stdout=subprocess.PIPE, columns="200"):
    command = [sys.executable, "-m", "marsched.cli", *args]
    return subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, text=True, cwd=cwd, timeout=300,
                          env={**os.environ, "COLUMNS": columns})


def one_line(text: str) -> str:
    return " ".join(text.split())


QUICK = ("--qps", "2", "--duration", "5")


# --- paths checked before any work ------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--json", "--trace-out"])
def test_simulate_rejects_a_directory_before_running(tmp_path, flag):
    run = marsched("simulate", *QUICK, flag, str(tmp_path))
    assert run.returncode == 2
    assert f"{flag} {tmp_path}: is a directory" in one_line(run.stderr)
    assert run.stdout == ""  # nothing ran: no table


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_compare_rejects_a_directory_before_running(tmp_path, flag):
    run = marsched("compare", "--policies", "mars", *QUICK, flag, str(tmp_path))
    assert run.returncode == 2
    assert f"{flag} {tmp_path}: is a directory" in one_line(run.stderr)
    assert run.stdout == ""


@pytest.mark.parametrize("path,reason", [
    ("/proc/marsched-out.json", "cannot write in /proc"),  # no new files there, even for root
    ("/sys/marsched-out.json", "cannot write in /sys"),
])
def test_an_unwritable_path_is_named_with_its_flag(path, reason):
    run = marsched("simulate", *QUICK, "--json", path)
    assert run.returncode == 2
    assert f"--json {path}: {reason}" in one_line(run.stderr)
    assert run.stdout == ""


def test_a_parent_that_is_a_file_is_named_with_its_flag(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    run = marsched("compare", "--policies", "mars", *QUICK, "--plot", str(blocker / "sub" / "plot.png"))
    assert run.returncode == 2
    assert f"--plot {blocker / 'sub' / 'plot.png'}: {blocker} is not a directory" in one_line(run.stderr)
    assert run.stdout == "" and blocker.read_text() == "x"


def test_missing_parent_folders_are_created(tmp_path):
    out = tmp_path / "new" / "dir" / "out.json"
    run = marsched("simulate", *QUICK, "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert json.loads(out.read_text())[0]["policy"] == "mars"


def test_bad_paths_leave_nothing_behind(tmp_path):
    run = marsched("simulate", *QUICK, "--json", str(tmp_path / "ok.json"), "--trace-out", str(tmp_path))
    assert run.returncode == 2
    assert list(tmp_path.iterdir()) == []  # neither the good output nor a probe or temporary file


# --- symlinks and special files -------------------------------------------------------------------


def test_a_symlink_is_written_through_and_stays_a_symlink(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    os.chmod(target, 0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "trace-target.jsonl")
    run = marsched("simulate", *QUICK, "--json", str(link), "--trace-out", str(dangling))
    assert run.returncode == 0, run.stderr
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())[0]["policy"] == "mars"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # the file kept its permissions
    assert dangling.is_symlink() and (tmp_path / "trace-target.jsonl").read_text().startswith('{"event"')


def test_dev_null_is_written_directly_and_stays_a_device():
    run = marsched("simulate", *QUICK, "--json", "/dev/null", "--trace-out", "/dev/null")
    assert run.returncode == 0, run.stderr
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_dev_full_fails_naming_the_flag_and_stays_a_device():
    run = marsched("simulate", *QUICK, "--trace-out", "/dev/full")
    assert run.returncode == 2
    assert "--trace-out /dev/full: writing failed: No space left on device" in one_line(run.stderr)
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)
    run = marsched("simulate", *QUICK, "--json", "/dev/full")
    assert run.returncode == 2 and "--json /dev/full: writing failed" in one_line(run.stderr)
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_dev_stdout_writes_to_the_stream_after_the_table(tmp_path):
    run = marsched("simulate", *QUICK, "--json", "/dev/stdout")
    assert run.returncode == 0, run.stderr
    table, _, rest = run.stdout.partition("\n[")
    assert "e2e mean" in table
    assert json.loads("[" + rest.split("\nmetrics:")[0])[0]["policy"] == "mars"
    # Redirected to a file, the stream is that file: it is appended at the stream's position,
    # not truncated, and the file is not replaced.
    out = tmp_path / "out.txt"
    with open(out, "w") as file:
        inode = os.fstat(file.fileno()).st_ino
        run = marsched("simulate", *QUICK, "--json", "/dev/stdout", stdout=file)
    assert run.returncode == 0, run.stderr
    text = out.read_text()
    assert out.stat().st_ino == inode
    assert text.index("e2e mean") < text.index('"policy": "mars"') < text.index("metrics: /dev/stdout")


def test_atomic_file_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")

    def boom(file):
        file.write(b"partial")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_atomically(path, boom)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.json"]
    output = AtomicFile(tmp_path / "new.json")
    output.file.write(b"x")
    output.discard()
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def _a_closed_descriptor() -> int:
    # Engines started in the background of the test process open low descriptors at any time;
    # the kernel hands out the lowest free number, so the last one the limit allows stays closed.
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (soft if soft != resource.RLIM_INFINITY else 1 << 20) - 1


def test_check_output_path_reports_without_touching(tmp_path):
    with pytest.raises(OutputPathError, match="is a directory"):
        check_output_path(tmp_path)
    closed_fd = _a_closed_descriptor()
    with pytest.raises(OutputPathError, match=f"file descriptor {closed_fd} is not open"):
        check_output_path(f"/dev/fd/{closed_fd}")
    check_output_path(tmp_path / "a" / "b.json")
    check_output_path("/dev/null")
    assert list(tmp_path.iterdir()) == []


# --- every message names its flag ------------------------------------------------------------------


@pytest.mark.parametrize("args,expected", [
    (("simulate", "--qps", "-1"), "--qps -1: give a finite number > 0"),
    (("simulate", "--qps", "nan"), "--qps nan: give a finite number > 0"),
    (("simulate", "--duration", "0"), "--duration 0: give a finite number > 0"),
    (("simulate", "--seed", "-1"), "--seed -1: give an integer from 0 to 2^32-1"),
    (("simulate", "--refresh-interval", "0"), "--refresh-interval 0:"),
    (("simulate", "--starvation", "bogus"), "--starvation bogus: unknown starvation variant"),
    (("simulate", "--admission", "bogus"), "--admission bogus: unknown rule"),
    (("simulate", "--predictor", "noisy:-1"), "--predictor noisy:-1: noisy predictor: sigma must be"),
    (("simulate", "--trace", "/nonexistent.json"), "--trace /nonexistent.json: file: no such file"),
    (("compare", "--qps", "3,nan"), "--qps '3,nan': give finite numbers > 0"),
    (("compare", "--workers", "-1"), "--workers -1: give 0 (one per core) or a number of processes >= 1"),
    (("compare", "--duration", "0"), "--duration 0: give a finite number > 0"),
    (("compare", "--policies", "mars,fifo"), "--policies fifo: unknown policy; valid:"),
])
def test_every_message_names_its_flag(args, expected):
    run = marsched(*args)
    assert run.returncode == 2
    message = one_line(run.stderr)
    assert expected in message
    assert "poisson_arrivals" not in message and "Traceback" not in run.stderr
    assert run.stdout == ""


def test_version():
    from marsched import __version__

    run = marsched("--version")
    assert run.returncode == 0 and run.stdout.strip() == f"marsched {__version__}"


def test_list_describes_every_choice():
    from marsched.cli import POLICY_HELP, STARVATION_HELP
    from marsched.policy.registry import POLICY_NAMES, STARVATION_NAMES
    from marsched.sim.profile import profile_names

    assert set(POLICY_HELP) == set(POLICY_NAMES) and set(STARVATION_HELP) == set(STARVATION_NAMES)
    run = marsched("list")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    for name in [*POLICY_NAMES, *STARVATION_NAMES, *profile_names(), "single", "multi", "agent", "oracle",
                 "noisy:SIGMA", "type-mean", "greedy", "predicted-peak"]:
        described = [line for line in lines if line.split()[:1] == [name] and len(line.split()) > 3]
        assert described, f"{name} has no description in `marsched list`"
    assert any(line.startswith("predictors") for line in lines)


# --- the table ------------------------------------------------------------------------------------


def test_rows_follow_the_policies_order_then_qps(tmp_path):
    out = tmp_path / "out.json"
    run = marsched("compare", "--policies", "vllm,mars,infercept", "--qps", "3,2", "--duration", "10",
                   "--workers", "1", "--json", str(out))
    assert run.returncode == 0, run.stderr
    rows = [line.split()[:2] for line in run.stdout.splitlines()
            if re.match(r"^\s*\d+(\.\d+)?\s+(vllm|mars|infercept)\s", line)]
    assert rows == [["2", "vllm"], ["3", "vllm"], ["2", "mars"], ["3", "mars"], ["2", "infercept"], ["3", "infercept"]]


def _in_a_terminal(args: list[str], columns: int) -> str:
    """Run marsched with stdout and stderr on a pseudo-terminal of `columns` columns."""
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "50", "TERM": "xterm"}
    process = subprocess.Popen([sys.executable, "-m", "marsched.cli", *args], stdout=follower, stderr=follower,
                               stdin=subprocess.DEVNULL, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    process.wait(300)
    os.close(leader)
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode("utf-8", "replace"))


def test_the_table_is_not_cut_at_80_columns(tmp_path):
    out = tmp_path / "out.json"
    text = _in_a_terminal(["compare", "--policies", "vllm,infercept,mars", "--qps", "2,16", "--duration", "20",
                           "--workers", "1", "--json", str(out)], 80)
    records = json.loads(out.read_text())
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for record in records:
        for value in (f"{record['e2e_mean_s']:.2f}", f"{record['e2e_p99_s']:.2f}", f"{record['ttft_mean_s']:.3f}",
                      f"{record['num_finished']}/{record['num_requests']}"):
            assert value in text, value


def test_the_table_is_whole_in_a_pipe_whatever_columns_says():
    run = marsched("simulate", "--qps", "16", "--duration", "20", columns="80")
    assert run.returncode == 0 and "…" not in run.stdout
