"""The vLLM names the plugin relies on (`marsched.vllm.private_names`) still exist, with the
parameters we pass; every vLLM import and every override is in that list; and
docs/vllm-internals.md shows the same list. A vLLM upgrade that renames or drops one fails here,
at once, instead of deep inside a live-engine test."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap
from pathlib import Path
from typing import Any

import pytest

from marsched.vllm.private_names import NAMES, OVERRIDES, VllmName, markdown_table

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "marsched"
SOURCES = sorted(p for folder in ("vllm", "serve", "bench") for p in (PACKAGE / folder).glob("*.py"))
DOC = ROOT / "docs" / "vllm-internals.md"
START, END = "<!-- private-names:start -->", "<!-- private-names:end -->"
INSTANCE = object()  # resolved to an attribute the class's own code assigns to `self`


# --- without vLLM ---------------------------------------------------------------------------

def test_each_name_is_listed_once() -> None:
    keys = [(n.module, n.path) for n in NAMES]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)


def vllm_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every `from vllm... import name` and `import vllm...` in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "vllm"]
    return found


def test_every_vllm_import_of_the_plugin_is_listed() -> None:
    missing = []
    for path in SOURCES:
        for module, name in vllm_imports(path):
            listed = any(n.module == module and (not name or n.path == name or n.path.startswith(name + "."))
                         for n in NAMES)
            if not listed:
                missing.append(f"{path.relative_to(ROOT)}: from {module} import {name}")
    assert not missing, "add these to marsched.vllm.private_names.NAMES:\n" + "\n".join(missing)


def test_the_import_scan_sees_imports() -> None:
    assert ("vllm.v1.core.sched.async_scheduler", "AsyncScheduler") in vllm_imports(PACKAGE / "vllm" / "scheduler.py")
    assert ("vllm", "LLM") in vllm_imports(PACKAGE / "bench" / "calibrate.py")  # imported inside a function


def test_docs_show_the_same_list() -> None:
    text = DOC.read_text()
    assert text.count(START) == 1 and text.count(END) == 1, f"{DOC.name}: one {START} ... {END} block"
    shown = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert shown == markdown_table(), (
        f"{DOC.name} does not show marsched.vllm.private_names.NAMES; paste the output of "
        "`python -c 'from marsched.vllm.private_names import markdown_table; print(markdown_table())'` "
        "between its markers")


# --- with vLLM ------------------------------------------------------------------------------

def instance_attributes(cls: type) -> set[str]:
    """Attributes an instance of `cls` has without the class having them: dataclass and msgspec
    fields, class annotations, and `self.NAME` assigned anywhere in the code of `cls` or a base."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        names.update(getattr(klass, "__annotations__", {}))
        names.update(getattr(klass, "__struct_fields__", ()))
        if dataclasses.is_dataclass(klass):
            names.update(f.name for f in dataclasses.fields(klass))
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(source)):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for target in targets:
                for part in ast.walk(target):
                    if (isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name)
                            and part.value.id == "self"):
                        names.add(part.attr)
    return names


def resolve(name: VllmName) -> Any:
    """The object `name.path` names in `name.module` (a class member as stored on the class:
    function, property, classmethod, ...), or INSTANCE for an attribute set on instances."""
    obj: Any = importlib.import_module(name.module)
    parts = name.path.split(".")
    for index, part in enumerate(parts):
        where = f"{name.module}.{'.'.join(parts[:index + 1])}"
        if inspect.isclass(obj):
            for klass in obj.__mro__:
                if part in vars(klass):
                    obj = vars(klass)[part]
                    break
            else:
                if hasattr(obj, part):  # e.g. an enum member
                    obj = getattr(obj, part)
                elif index == len(parts) - 1 and part in instance_attributes(obj):
                    return INSTANCE
                else:
                    raise AssertionError(f"{where}: no such attribute in this vLLM ({name.use})")
        else:
            assert hasattr(obj, part), f"{where}: no such attribute in this vLLM ({name.use})"
            obj = getattr(obj, part)
    return obj


def callable_of(obj: Any) -> Any:
    return obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj


def parameters(obj: Any) -> list[inspect.Parameter]:
    """The parameters of a function or class (a TypedDict: its keys), without `self` / `cls`."""
    target = callable_of(obj)
    if hasattr(target, "__required_keys__"):  # a TypedDict takes its keys
        return [inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY) for key in target.__annotations__]
    params = list(inspect.signature(target).parameters.values())
    if inspect.isfunction(target) and not isinstance(obj, staticmethod) and params and params[0].name in ("self", "cls"):
        params = params[1:]
    return params


@pytest.mark.vllm
@pytest.mark.parametrize("name", NAMES, ids=[f"{n.module}:{n.path}" for n in NAMES])
def test_name_resolves_with_the_parameters_we_pass(name: VllmName) -> None:
    obj = resolve(name)
    if not name.params:
        return
    assert obj is not INSTANCE and callable(callable_of(obj)), f"{name.module}.{name.path}: not callable"
    have = [p.name for p in parameters(obj)]
    missing = [p for p in name.params if p not in have]
    assert not missing, f"{name.module}.{name.path}{tuple(have)} has no parameter {missing} ({name.use})"


def check_override(ours: Any, theirs: Any, where: str) -> None:
    """An override must accept every call vLLM makes: vLLM's parameters, in order, by name."""
    if isinstance(theirs, property) or isinstance(ours, property):
        assert isinstance(ours, property) and isinstance(theirs, property), f"{where}: property against method"
        return
    our_params, their_params = parameters(ours), parameters(theirs)
    variadic = {p.kind for p in our_params} & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
    named = [p for p in our_params if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    their_named = [p for p in their_params
                   if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if not named:
        assert variadic or not their_named, f"{where}: vLLM passes {[p.name for p in their_named]}, we take none"
        return
    ours_names, their_names = [p.name for p in named], [p.name for p in their_named]
    assert ours_names == their_names[:len(ours_names)], f"{where}: we take {ours_names}, vLLM's is {their_names}"
    assert len(their_named) <= len(named) or variadic, f"{where}: vLLM also passes {their_names[len(named):]}"
    for mine, base in zip(named, their_named):
        assert base.default is inspect.Parameter.empty or mine.default is not inspect.Parameter.empty, (
            f"{where}: vLLM's {base.name!r} has a default (callers may leave it out); ours has none")


@pytest.mark.vllm
@pytest.mark.parametrize("our_module, our_class, base_module, base_class", OVERRIDES,
                         ids=[f"{o[1]}-{o[2]}.{o[3]}" for o in OVERRIDES])
def test_overrides_are_listed_and_match_vllms_signatures(our_module: str, our_class: str,
                                                         base_module: str, base_class: str) -> None:
    ours = getattr(importlib.import_module(our_module), our_class)
    base = getattr(importlib.import_module(base_module), base_class)
    listed = [resolve(n) for n in NAMES]
    overrides = 0
    seen: set[str] = set()
    for klass in ours.__mro__:
        if not klass.__module__.startswith("marsched."):
            continue
        for member, value in vars(klass).items():
            if member in seen or (not isinstance(value, (property, classmethod, staticmethod))
                                  and not inspect.isfunction(value)):
                continue
            seen.add(member)  # the first definition in the MRO is the one vLLM calls
            owner = next((k for k in base.__mro__ if member in vars(k)), None)
            if owner is None or not owner.__module__.startswith("vllm."):
                continue  # ours alone, or object's
            check_listed_override(klass, member, value, owner, listed)
            overrides += 1
    assert overrides, f"{our_class} overrides nothing of {base_module}.{base_class}"


def check_listed_override(klass: type, member: str, value: Any, owner: type, listed: list[Any]) -> None:
    theirs = vars(owner)[member]
    where = f"{klass.__qualname__}.{member} over {owner.__module__}.{owner.__qualname__}.{member}"
    assert any(obj is theirs for obj in listed), f"{where}: add it to marsched.vllm.private_names.NAMES"
    check_override(value, theirs, where)


def test_check_override_rejects_what_vllm_could_not_call() -> None:
    def base(self, request, timestamp, drop_stale_output=False): ...
    def renamed(self, req, timestamp, drop_stale_output=False): ...
    def short(self, request, timestamp): ...
    def no_default(self, request, timestamp, drop_stale_output): ...
    def forwards(self, *args, **kwargs): ...
    def absorbs(self, request, *args, **kwargs): ...
    for wrong in (renamed, short, no_default):
        with pytest.raises(AssertionError):
            check_override(wrong, base, wrong.__name__)
    check_override(forwards, base, "forwards")
    check_override(absorbs, base, "absorbs")


@pytest.mark.vllm
def test_the_api_server_keeps_its_engine_client_where_the_middlewares_read_it() -> None:
    from vllm.entrypoints.launchers.api_server import app_state

    assert "state.engine_client = " in inspect.getsource(app_state.init_app_state)
