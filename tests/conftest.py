"""Fixtures for the vLLM tests: the tiny model, an event loop thread, and the shared engines and servers.

The shared ones (tests/shared.py; configurations in tests/engines.py, tests/servers.py and
tests/commands.py) are session fixtures of their names: those the collected tests use start with
the session in the background (the engines and servers one after the other, the commands one
after the other beside them), and each is stopped after the last test that uses it. A test marked `stops_shared` (it stops its shared engine or server itself) runs after the
other tests on it. The tests that read a command's outcome run last, so that the commands run in
the background while the other tests run.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

import commands
import engines
import servers
from loop_thread import LoopThread
from shared import SharedPool

# Before vLLM is imported: 1 GiB of CPU KV cache; the in-process LLM keeps its engine
# core in this process (AsyncLLM always starts its own engine-core process).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

SHARED = {**engines.SHARED, **servers.SHARED, **commands.SHARED}  # fixture name -> factory(model, folder)
_first_use: dict[str, str] = {}  # shared fixture -> node id of the first test that uses it, in test order
_last_user: dict[str, str] = {}  # shared fixture -> node id of the last test that uses it
_pool: list[SharedPool] = []  # the session's, once a test has needed one


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("vllm")
    from tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def loop_thread():
    runner = LoopThread()
    yield runner
    runner.close()


# --- shared engines and servers ----------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stops_shared: stops the shared engine or server it uses; runs after "
                                       "every other test on it")


def _shared_of(item: pytest.Item) -> list[str]:
    return [name for name in SHARED if name in item.fixturenames]


@pytest.hookimpl(trylast=True)  # after -m/-k deselection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    readers = [item for item in items if set(_shared_of(item)) & set(commands.SHARED)]
    for item in readers:  # stable: they keep their order among themselves
        items.remove(item)
    items.extend(readers)
    for stopper in [item for item in items if item.get_closest_marker("stops_shared")]:
        names = set(_shared_of(stopper))
        items.remove(stopper)
        last = max((i for i, item in enumerate(items) if names & set(_shared_of(item))), default=len(items) - 1)
        items.insert(last + 1, stopper)
    _first_use.clear()
    _last_user.clear()
    for item in items:
        for name in _shared_of(item):
            _first_use.setdefault(name, item.nodeid)
            _last_user[name] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    for name, nodeid in _last_user.items():
        if nodeid == item.nodeid and _pool:
            _pool[0].stop(name)


@pytest.fixture(scope="session")
def shared_pool(tiny_model, tmp_path_factory):
    lanes = [[name for name in _first_use if (name in commands.SHARED) == is_command] for is_command in (False, True)]
    pool = SharedPool(SHARED, tiny_model, tmp_path_factory.mktemp, lanes)
    _pool.append(pool)
    yield pool
    pool.close()
    _pool.clear()


@pytest.fixture(scope="session", autouse=True)
def _shared_start_early(request):
    """What the session shares starts with it, in the background (shared.py)."""
    if _first_use and importlib.util.find_spec("vllm") is not None:  # without vLLM, their tests skip
        request.getfixturevalue("shared_pool").start_in_background()


def _shared_fixture(name: str, doc: str):
    @pytest.fixture(scope="session", name=name)
    def fixture(shared_pool):
        return shared_pool.get(name)

    fixture.__doc__ = doc
    return fixture


runtime_engine = _shared_fixture("runtime_engine", "`engines.RUNTIME`: MARS, per-request strategies allowed.")
audit_vllm_engine = _shared_fixture("audit_vllm_engine", "`engines.AUDITED['vllm']`: stock vLLM's rule.")
audit_infercept_engine = _shared_fixture("audit_infercept_engine", "`engines.AUDITED['infercept']`.")
audit_discard_engine = _shared_fixture("audit_discard_engine", "`engines.AUDITED['discard']`: a fixed strategy.")
learned_engine = _shared_fixture("learned_engine", "`engines.LEARNED`: MARS with learned length predictions.")
chat_server = _shared_fixture("chat_server", "`servers.CHAT`: plain requests and client-side tool calls, "
                                             "a short retention limit.")
tools_server = _shared_fixture("tools_server", "`servers.TOOLS`: server-side tools (`--tools`), 48 KV blocks, "
                                               "a long retention limit.")
dp_server = _shared_fixture("dp_server", "`servers.DATA_PARALLEL`: two data-parallel ranks, a 15 s retention limit.")
loadgen_server = _shared_fixture("loadgen_server", "`servers.LOADGEN`: reply lengths forced by the bench "
                                                   "processor, the oracle predictor.")
bench_run = _shared_fixture("bench_run", "`commands.BENCH`: `marsched model`, then `marsched bench`.")
http_bench_run = _shared_fixture("http_bench_run", "`commands.HTTP_BENCH`: a short HTTP comparison.")
twin_run = _shared_fixture("twin_run", "`commands.TWIN`: the live twin's smoke, one configuration.")
overhead_run = _shared_fixture("overhead_run", "`commands.OVERHEAD`: the overhead benchmark, connector on.")
parity_run = _shared_fixture("parity_run", "`commands.PARITY`: the lifecycle parity stream on real vLLM.")
calibrate_run = _shared_fixture("calibrate_run", "`commands.CALIBRATE`: `marsched calibrate --fast`.")
assert all(name in globals() for name in SHARED), "a shared engine or server without its fixture"
