"""`marsched.vllm.private_names.NAMES` checked statically against vLLM source
(`marsched.vllm.source_names`): the resolver on small made-up sources, its agreement with the
installed vLLM (which tests/test_vllm_private_names.py checks by importing it), and vLLM 0.33.0's
wheel, downloaded once into ~/.cache/marsched/wheels (skipped only when no package index can be
reached)."""

from __future__ import annotations

import importlib.util
import subprocess
import textwrap
from pathlib import Path

import pytest

from marsched.vllm import source_names
from marsched.vllm.private_names import NAMES, VllmName
from marsched.vllm.source_names import (
    Param, Resolver, Source, WheelUnavailable, check, check_names, check_overrides, fetch_wheel, main,
    override_problem,
)

RELEASE = "0.33.0"  # the vLLM GPU users run (docs/vllm-internals.md, "vLLM 0.33")


def source(modules: dict[str, str]) -> Source:
    """Made-up modules by path: {"vllm/a.py": "..."}."""
    return Source({path: textwrap.dedent(text).encode() for path, text in modules.items()}, "made-up vLLM")


FAKE = source({
    "vllm/__init__.py": """
        import typing
        from .version import __version__
        if typing.TYPE_CHECKING:
            from vllm.engine import Engine
        else:
            def __getattr__(name): ...
        """,
    "vllm/version.py": "__version__ = '9.9'",
    "vllm/engine.py": """
        from vllm.base import *
        from vllm.base import Base as Renamed

        class Engine(Renamed):
            limit: int = 3

            def __init__(self, model, *, seed=0):
                self.queue = []

            def step(self, request, timestamp, drop=False): ...
        """,
    "vllm/base.py": """
        import enum
        try:
            from vllm.fast import Helper
        except ImportError:
            Helper = object

        class Status(enum.Enum):
            PAUSED = 1

        class Base:
            def schedule(self): ...

            @classmethod
            def build(cls, config, extra=None): ...
        """,
    "vllm/fast.py": "class Helper: ...",
    "vllm/config.py": """
        from dataclasses import dataclass

        @dataclass
        class Config:
            name: str
            size: int = 1
        """,
})


@pytest.mark.parametrize("module, path", [
    ("vllm", "__version__"),  # an import followed
    ("vllm", "Engine.step"),  # a TYPE_CHECKING import
    ("vllm.engine", "Engine.schedule"),  # through a base imported under another name
    ("vllm.engine", "Engine.queue"),  # an instance attribute
    ("vllm.engine", "Engine.limit"),
    ("vllm.engine", "Status.PAUSED"),  # a star import, an enum member
    ("vllm.base", "Helper"),
    ("vllm.base", "Base.build"),
])
def test_names_resolve_the_way_python_finds_them(module, path):
    assert check_names(Resolver(FAKE), (VllmName(module, path, "test"),)) == []


def test_what_is_missing_is_named():
    names = (VllmName("vllm.engine", "Engine.stop", "gone"), VllmName("vllm.gone", "X", "no module"),
             VllmName("vllm.engine", "Engine.step", "renamed", ("request", "time")),
             VllmName("vllm.engine", "Engine.limit", "not callable", ("x",)))
    problems = check_names(Resolver(FAKE), names)
    assert problems == [
        "vllm.engine.Engine.stop: not found in made-up vLLM (gone)",
        "vllm.gone.X: not found in made-up vLLM (no module)",
        "vllm.engine.Engine.step('request', 'timestamp', 'drop') has no parameter ['time'] (renamed)",
        "vllm.engine.Engine.limit: not callable in made-up vLLM (not callable)",
    ]


def test_parameters_of_functions_and_classes():
    resolver = Resolver(FAKE)
    assert resolver.params(resolver.resolve("vllm.engine", "Engine")) == [
        Param("model", "positional", False), Param("seed", "keyword", True)]
    assert [p.name for p in resolver.params(resolver.resolve("vllm.base", "Base.build"))] == ["config", "extra"]
    assert resolver.params(resolver.resolve("vllm.config", "Config")) == [
        Param("name", "positional", False), Param("size", "positional", True)]  # a dataclass's fields
    assert resolver.lookup("vllm.base", "Helper").kind == "class"  # the import, not the except fallback


def test_override_rule():
    base = [Param("request", "positional", False), Param("timestamp", "positional", False),
            Param("drop", "positional", True)]
    assert override_problem(base, base, "same") is None
    assert override_problem(base[:1] + [Param("a", "var_positional", False)], base, "absorbs") is None
    assert "we take" in override_problem([Param("req", "positional", False)] + base[1:], base, "renamed")
    assert "also passes ['drop']" in override_problem(base[:2], base, "short")
    assert "has a default" in override_problem(base[:2] + [Param("drop", "positional", False)], base, "no default")


def test_a_release_that_adds_a_method_named_like_ours_is_caught():
    """Our class (read from marsched's source) over a made-up base that now has `on_step`."""
    made_up = source({
        "marsched/fake_plugin.py": """
            from vllm.engine import Engine

            class Plugin(Engine):
                def step(self, request, timestamp, drop=False): ...
                def on_step(self): ...
            """,
        "vllm/engine.py": """
            class Engine:
                def step(self, request, timestamp, drop=False, extra=None): ...
                def on_step(self, output): ...
            """})
    listed = (VllmName("vllm.engine", "Engine.step", "override"),)
    problems = check_overrides(Resolver(made_up), (("marsched.fake_plugin", "Plugin", "vllm.engine", "Engine"),), listed)
    assert problems == [
        "Plugin.step over vllm.engine.Engine.step: vLLM also passes ['extra']",
        "Plugin.on_step over vllm.engine.Engine.on_step: an override not in marsched.vllm.private_names.NAMES",
        "Plugin.on_step over vllm.engine.Engine.on_step: vLLM passes ['output'], we take none",
    ]


def test_the_wheel_comes_from_the_cache_without_pip(tmp_path, monkeypatch):
    cached = tmp_path / f"vllm-{RELEASE}-cp38-abi3-manylinux_2_28_x86_64.whl"
    cached.write_bytes(b"")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip ran although the wheel is cached"))
    assert fetch_wheel(RELEASE, tmp_path) == cached


@pytest.mark.parametrize("said, offline", [
    ("WARNING: Retrying ... NewConnectionError: Failed to establish a new connection", True),
    ("ERROR: No matching distribution found for vllm==0.0.1", False),
])
def test_a_failed_download_says_whether_the_index_was_unreachable(tmp_path, monkeypatch, said, offline):
    monkeypatch.setattr(subprocess, "run", lambda command, **k: subprocess.CompletedProcess(command, 1, "", said))
    with pytest.raises(WheelUnavailable) as raised:
        fetch_wheel("0.0.1", tmp_path)
    assert raised.value.offline is offline and said in str(raised.value)
    assert list(tmp_path.iterdir()) == []  # no partial download is left in the cache


def installed_vllm() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed (scripts/setup.sh --vllm)")
    return Path(list(spec.submodule_search_locations)[0]).parent


@pytest.mark.vllm
def test_the_static_check_agrees_with_the_installed_vllm(capsys):
    """tests/test_vllm_private_names.py resolves every name by importing this vLLM; read
    statically, its source must resolve them too (else the check of another release means nothing)."""
    root = installed_vllm()
    assert check(Source.from_directory(root)) == []
    assert main([str(root)]) == 0
    assert f"{len(NAMES)} names" in capsys.readouterr().out


@pytest.mark.timeout(1800)
def test_every_name_resolves_in_vllm_0_33_0():
    """The release GPU users run: its wheel's Python files (only), downloaded once and cached."""
    try:
        wheel = fetch_wheel(RELEASE)
    except WheelUnavailable as error:
        if error.offline:
            pytest.skip(f"vllm=={RELEASE} cannot be downloaded: no package index reachable ({error})")
        raise
    problems = check(Source.from_wheel(wheel))
    assert not problems, f"vllm {RELEASE}:\n" + "\n".join(problems)


def test_the_cache_is_outside_the_repository(monkeypatch, tmp_path):
    monkeypatch.delenv("MARSCHED_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert source_names.cache_dir() == tmp_path / "marsched" / "wheels"
    monkeypatch.setenv("MARSCHED_CACHE", str(tmp_path / "elsewhere"))
    assert source_names.cache_dir() == tmp_path / "elsewhere" / "wheels"
