"""The layer rules of the repository, checked on the source text.

Imports are read with ``ast`` (no module is imported), so the check is fast
and sees every import a module makes: module-level ones, those inside
functions, and those under ``if TYPE_CHECKING:``. All three are counted, for
circles and for floors alike: a function-level import only postpones a
dependency to the first call, and a type-only import still means that a
module cannot be read, tested or moved without the one it names (the issue
that introduced this test listed two type-only upward arrows as leaks).

The rules:

* ``launch/`` and ``models/`` import only the public faces of the library,
  ``capricorn_jax`` and ``capricorn_jax.experimental``;
* the library (``capricorn_jax/``) imports nothing from ``launch/``,
  ``models/`` or ``tests/``;
* no module of ``capricorn_jax._src`` imports a face module;
* no import circle between modules of the library;
* the concept folders of ``capricorn_jax._src`` lie on the floors of
  ``FLOORS``, and a module imports only from its own folder or from a lower
  floor (never upward, never sideways into another folder of its floor);
* a concept folder with sub-folders on floors of their own (``SUB_FLOORS``:
  the scheduler's pure plan under its two chunk paths) keeps the same rule
  one level down;
* the JAX-free packages (``PURE``: the scheduler's ``plan/``) import none of
  the named distributions, directly or through any library module they
  reach (a reached module's packages under ``_src`` included: their
  ``__init__`` runs too; the face ``capricorn_jax`` above them imports JAX
  by design and is not counted);
* the launchers' shared modules (``LAUNCH_SHARED``: the cluster harness,
  the flags, the trainer, ...) import no command package (``COMMANDS``):
  a command builds on them, never the other way.

Design choice: the checker is a pure function of a source tree (``check``),
so the self-check runs it over a synthetic tree with a planted upward import
and a planted circle and asserts that both are reported. Alternative not
taken: a third-party layering tool (import-linter), one more dependency and
one more configuration format for five rules.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import HEAVY

ROOT = Path(__file__).resolve().parents[1]
LIB = "capricorn_jax"
SRC = f"{LIB}._src"
FACES = (LIB, f"{LIB}.experimental", f"{LIB}.stores",
         *(f"{LIB}.experimental.{m}" for m in ("planning", "store", "testing", "measuring",
                                               "multihost", "strategies", "profiling")))
"""The faces: the stable API, the stores command, and the unstable names by audience."""
TOOLS = ("launch", "models")
COMMANDS = ("launch.train", "launch.bench", "launch.chaos")
"""The launchers' command packages (each with its own helpers)."""
LAUNCH_SHARED = ("launch.cluster", "launch.cli_flags", "launch.trainer", "launch.data",
                 "launch.strategies", "launch.baselines", "launch.runtime", "launch.accelerator",
                 "launch.metrics", "launch.tiers")
"""What the commands share."""

FLOORS: tuple[tuple[str, ...], ...] = (
    ("strategies",),
    ("persistent", "scheduling"),
    ("memory", "profiling"),
    ("partial", "multihost", "native"),
)
"""The floors of ``_src``, top first. Strategies compose the tiers and the
schedule; the persistent tier reads the memory tier, the scheduler moves
memory-tier chunks at profiled boundaries; the memory tier stores bytes and
profiling measures the step, neither knowing the other; the PEC decision logic
and the cross-host agreement are pure building blocks under all of them, as
are the native handlers (built with the host's compiler at first use)."""

SUB_FLOORS: dict[str, tuple[tuple[str, ...], ...]] = {
    "scheduling": (("in_graph", "threaded"), ("plan",)),
}
"""Floors inside a concept folder, top first, by folder: the scheduler's two
chunk paths (in the step's XLA program on GPU, on host threads on CPU) build
on its pure plan and never on each other; the plan knows neither."""

PURE: dict[str, tuple[str, ...]] = {
    f"{SRC}.scheduling.plan": HEAVY,
}
"""Packages of the library that import none of these distributions, directly
or through the library modules they reach: the planner replays their
decisions without a device."""


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_files(root: Path, top: str) -> Iterator[Path]:
    base = root / top
    if not base.exists():
        return
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
        for f in sorted(filenames):
            if f.endswith((".py", ".pyi")):  # a face's imports are in its stub
                yield Path(dirpath) / f


def imports_of(root: Path, path: Path, known: set[str]) -> list[Import]:
    """Every import statement of ``path`` (at any depth), resolved to module
    names: ``from a.b import c`` names ``a.b.c`` when that is a module of the
    tree, else ``a.b``."""
    name = module_name(root, path)
    is_pkg = path.stem == "__init__"
    package = name if is_pkg else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [Import(name, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                full = f"{mod}.{a.name}"
                out.append(Import(name, full if full in known else mod, node.lineno))
    return out


def graph(root: Path) -> tuple[set[str], list[Import]]:
    files = [p for top in (LIB, *TOOLS) for p in python_files(root, top)]
    known = {module_name(root, p) for p in files}
    imports = [i for p in files for i in imports_of(root, p, known)]
    return known, list(dict.fromkeys(imports))


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def floor_of(module: str) -> tuple[int, str] | None:
    """(floor index, folder) of a module of ``_src`` (0 = top), None outside."""
    if not _in(module, SRC) or module == SRC:
        return None
    folder = module[len(SRC) + 1:].split(".")[0]
    for i, floor in enumerate(FLOORS):
        if folder in floor:
            return i, folder
    return -1, folder


def sub_floor_of(module: str) -> tuple[int, str] | None:
    """(floor index, sub-folder) of a module in a folder of ``SUB_FLOORS``
    (0 = top; -1: a sub-folder on no floor); None elsewhere, and for the
    folder's own modules."""
    parts = module[len(SRC) + 1:].split(".") if _in(module, SRC) else []
    if len(parts) < 2 or parts[0] not in SUB_FLOORS:
        return None
    for i, floor in enumerate(SUB_FLOORS[parts[0]]):
        if parts[1] in floor:
            return i, parts[1]
    return -1, parts[1]


def _packages(module: str) -> list[str]:
    """The packages above ``module`` inside ``_src`` (their ``__init__`` runs
    when it is imported), nearest first."""
    parts = module.split(".")
    return [p for p in (".".join(parts[:n]) for n in range(len(parts) - 1, 0, -1))
            if _in(p, SRC)]


def impure(known: set[str], imports: list[Import]) -> list[str]:
    """Every import of a banned distribution that a module of a ``PURE``
    package reaches, once each, with the chain of library modules to it."""
    by_importer: dict[str, list[Import]] = {}
    for i in imports:
        by_importer.setdefault(i.importer, []).append(i)
    out: dict[tuple[str, int, str], str] = {}
    for package, banned in PURE.items():
        for start in sorted(m for m in known if _in(m, package)):
            paths = {m: [start, m] for m in _packages(start) if m in known}
            paths[start] = [start]
            todo = list(paths)
            while todo:
                module = todo.pop(0)
                for i in by_importer.get(module, ()):
                    if i.imported.split(".")[0] in banned:
                        out.setdefault((i.importer, i.line, i.imported), " -> ".join(
                            paths[module][:-1] + [f"{module}:{i.line} imports {i.imported}"]))
                    if not _in(i.imported, LIB) or i.imported not in known:
                        continue
                    via = module  # a package is reached through the module it holds
                    for reached in (i.imported, *_packages(i.imported)):
                        if reached in known and reached not in paths:
                            paths[reached] = [*paths[via], reached]
                            todo.append(reached)
                        via = reached if reached in paths else via
    return sorted(out.values())


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def check(root: Path) -> dict[str, list[str]]:
    """Every breach of the rules in the tree at ``root``, by rule."""
    known, imports = graph(root)
    found: dict[str, list[str]] = {
        "tools_private": [], "lib_imports_tools": [], "src_imports_face": [],
        "unknown_folder": [], "upward": [], "sideways": [], "circles": [],
        "shared_imports_command": [], "impure": []}
    edges: dict[str, set[str]] = {}
    for i in imports:
        where = f"{i.importer}:{i.line} imports {i.imported}"
        if (any(_in(i.importer, m) for m in LAUNCH_SHARED)
                and any(_in(i.imported, c) for c in COMMANDS)):
            found["shared_imports_command"].append(where)
        if any(_in(i.importer, t) for t in TOOLS):
            if _in(i.imported, LIB) and i.imported not in FACES:
                found["tools_private"].append(where)
            continue
        if any(_in(i.imported, t) for t in (*TOOLS, "tests")):
            found["lib_imports_tools"].append(where)
        if not _in(i.imported, LIB):
            continue
        if i.imported in known and i.imported != i.importer:
            edges.setdefault(i.importer, set()).add(i.imported)
        src, dst = floor_of(i.importer), floor_of(i.imported)
        if src is not None and i.imported in FACES:
            found["src_imports_face"].append(where)
        if src is None or dst is None:
            continue
        for f in {src, dst}:
            if f[0] == -1:
                found["unknown_folder"].append(f"{f[1]} (from {where})")
        if src[1] == dst[1] and -1 not in (src[0], dst[0]):
            src, dst = sub_floor_of(i.importer), sub_floor_of(i.imported)
            if src is None or dst is None:
                continue
            for f in {src, dst}:
                if f[0] == -1:
                    found["unknown_folder"].append(f"{f[1]} (from {where})")
        if src[1] == dst[1] or -1 in (src[0], dst[0]):
            continue
        if dst[0] < src[0]:
            found["upward"].append(where)
        elif dst[0] == src[0]:
            found["sideways"].append(where)
    found["circles"] = [" <-> ".join(c) for c in circles(edges)]
    found["impure"] = impure(known, imports)
    return found


def test_layer_rules_hold():
    found = check(ROOT)
    assert found == {k: [] for k in found}, found


def test_face_modules_exist():
    known, _ = graph(ROOT)
    assert set(FACES) <= known
    folders = {m[len(SRC) + 1:].split(".")[0] for m in known if _in(m, SRC) and m != SRC}
    assert folders == {f for floor in FLOORS for f in floor}
    for folder, floors in SUB_FLOORS.items():
        inside = {sub_floor_of(m) for m in known if _in(m, f"{SRC}.{folder}")} - {None}
        assert {sub for _, sub in inside} == {f for floor in floors for f in floor}
    assert all(package in known for package in PURE)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _synthetic(root: Path) -> None:
    for pkg in ("capricorn_jax", "capricorn_jax/_src", *(
            f"capricorn_jax/_src/{f}" for floor in FLOORS for f in floor), "launch"):
        _write(root, f"{pkg}/__init__.py", "")
    _write(root, "capricorn_jax/experimental.py", "")
    _write(root, "capricorn_jax/_src/memory/store.py", "import os\n")
    _write(root, "capricorn_jax/_src/strategies/base.py",
           "from capricorn_jax._src.memory import store\n")
    _write(root, "launch/train/__init__.py",
           "import capricorn_jax\nfrom capricorn_jax import experimental\n")


def test_checker_passes_a_clean_tree(tmp_path):
    _synthetic(tmp_path)
    found = check(tmp_path)
    assert found == {k: [] for k in found}


def test_checker_reports_an_upward_import(tmp_path):
    _synthetic(tmp_path)
    _write(tmp_path, "capricorn_jax/_src/memory/checkpointer.py",
           "import jax\n\ndef f():\n    from capricorn_jax._src.strategies.base import X\n")
    found = check(tmp_path)
    assert found["upward"] == [
        "capricorn_jax._src.memory.checkpointer:4 imports capricorn_jax._src.strategies.base"]
    assert found["circles"] == []


def test_checker_reports_type_checking_circles_sideways_and_faces(tmp_path):
    _synthetic(tmp_path)
    _write(tmp_path, "capricorn_jax/_src/memory/store.py",
           "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
           "    from . import tier\nfrom ..profiling import probe\n")
    _write(tmp_path, "capricorn_jax/_src/memory/tier.py", "from .store import HostStore\n")
    _write(tmp_path, "capricorn_jax/_src/profiling/probe.py",
           "from capricorn_jax.experimental import X\n")
    _write(tmp_path, "launch/admin.py", "from capricorn_jax._src.memory.store import HostStore\n"
           "import models\n")
    _write(tmp_path, "capricorn_jax/_src/partial/x.py", "import launch.train\n")
    _write(tmp_path, "launch/cluster/processes.py", "from launch.train import config\n")
    found = check(tmp_path)
    assert found["circles"] == [
        "capricorn_jax._src.memory.store <-> capricorn_jax._src.memory.tier"]
    assert found["sideways"] == [
        "capricorn_jax._src.memory.store:4 imports capricorn_jax._src.profiling.probe"]
    assert found["src_imports_face"] == [
        "capricorn_jax._src.profiling.probe:1 imports capricorn_jax.experimental"]
    assert found["tools_private"] == [
        "launch.admin:1 imports capricorn_jax._src.memory.store"]
    assert found["lib_imports_tools"] == [
        "capricorn_jax._src.partial.x:1 imports launch.train"]
    assert found["upward"] == []
    assert found["shared_imports_command"] == [
        "launch.cluster.processes:1 imports launch.train"]


_IMPORT_BLOCKED = """
import importlib, importlib.abc, pkgutil, sys, types
from pathlib import Path
banned, package = tuple(sys.argv[1].split(",")), sys.argv[2]
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in banned:
            raise ImportError(f"{name}: blocked")
sys.meta_path.insert(0, Block())
for name in ("capricorn_jax", "capricorn_jax._src"):  # the face's __init__ imports JAX
    stub = types.ModuleType(name)
    stub.__path__ = [str(Path.cwd().joinpath(*name.split(".")))]
    sys.modules[name] = stub
pure = importlib.import_module(package)
for m in pkgutil.walk_packages(pure.__path__, package + "."):
    importlib.import_module(m.name)
"""


@pytest.mark.parametrize("package", sorted(PURE))
def test_pure_package_imports_with_its_banned_distributions_blocked(package):
    """The static rule's run-time twin: every module of the package imports
    in a fresh interpreter where importing a banned distribution fails
    (the face's ``__init__`` stubbed: it imports JAX by design)."""
    done = subprocess.run([sys.executable, "-c", _IMPORT_BLOCKED, ",".join(PURE[package]),
                           package], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_checker_reports_jax_reached_from_a_pure_package(tmp_path):
    _synthetic(tmp_path)
    for rel, text in {
            "scheduling/plan/__init__.py": "",
            "scheduling/plan/windows.py": "import numpy\nfrom ...profiling import probe\n"
                                          "from ..plan import sites\n",
            "scheduling/plan/sites.py": "from capricorn_jax._src.native.marks import MarkTable\n",
            "profiling/probe.py": "import os\n\ndef f():\n    import jax.numpy as jnp\n",
            "native/__init__.py": "import jax\n",
            "native/marks.py": "import ctypes\n"}.items():
        _write(tmp_path, f"capricorn_jax/_src/{rel}", text)
    found = check(tmp_path)
    plan = "capricorn_jax._src.scheduling.plan"
    assert found["impure"] == [
        # through a module's package: native/__init__ runs before native.marks
        f"{plan}.sites -> capricorn_jax._src.native.marks -> capricorn_jax._src.native:1 "
        "imports jax",
        f"{plan}.windows -> capricorn_jax._src.profiling.probe:4 imports jax.numpy"]
    # the same tree with the imports gone is clean
    _write(tmp_path, "capricorn_jax/_src/native/__init__.py", "")
    _write(tmp_path, "capricorn_jax/_src/profiling/probe.py", "import numpy\n")
    assert check(tmp_path)["impure"] == []


def test_checker_reports_the_sub_floors(tmp_path):
    _synthetic(tmp_path)
    for rel, text in {
            "scheduling/plan/__init__.py": "",
            "scheduling/plan/sites.py": "from capricorn_jax._src.scheduling.threaded import pace\n",
            "scheduling/in_graph/__init__.py": "",
            "scheduling/in_graph/executor.py": "from ..plan import sites\n",
            "scheduling/threaded/__init__.py": "",
            "scheduling/threaded/pace.py": "from ..plan.sites import START\n",
            "scheduling/threaded/sender.py": "from ..in_graph.executor import X\n",
            "scheduling/loose/x.py": "from ..plan import sites\n"}.items():
        _write(tmp_path, f"capricorn_jax/_src/{rel}", text)
    found = check(tmp_path)
    assert found["upward"] == [
        "capricorn_jax._src.scheduling.plan.sites:1 imports "
        "capricorn_jax._src.scheduling.threaded.pace"]
    assert found["sideways"] == [
        "capricorn_jax._src.scheduling.threaded.sender:1 imports "
        "capricorn_jax._src.scheduling.in_graph.executor"]
    assert found["unknown_folder"] == [
        "loose (from capricorn_jax._src.scheduling.loose.x:1 imports "
        "capricorn_jax._src.scheduling.plan.sites)"]
    assert found["circles"] == [
        "capricorn_jax._src.scheduling.plan.sites <-> capricorn_jax._src.scheduling.threaded.pace"]


if __name__ == "__main__":
    for rule, items in check(ROOT).items():
        print(f"{rule}: {len(items)}")
        for item in items:
            print(f"  {item}")
    raise SystemExit(pytest.main([__file__, "-q"]))
