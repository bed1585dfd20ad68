"""The faces' names, imported on first use.

A face (``capricorn_jax``, ``capricorn_jax.experimental`` and its modules by
audience) lists its names as imports in a stub beside it (``__init__.pyi``,
``planning.pyi``): type checkers and readers see the names and where they come
from there. At run time the face's module holds no import; ``attach`` reads
the stub and imports a name's module when the name is first asked for. So a
process that needs one options dataclass (a launcher's supervisor validating
its flags, ``python -m capricorn_jax.stores``) imports what that class needs,
not JAX, Flax and Orbax (1.7 s of CPU per process on a 2-core host).

Design choice: the stub as the one list of names (the convention of
scientific Python's SPEC 1, lazy loading through a ``.pyi``). Alternatives
not taken: eager imports in the face (every user of any name pays for all of
them), a second list of names in code beside a ``TYPE_CHECKING`` block (two
lists to keep equal), the ``lazy_loader`` package (one more dependency for
forty lines).
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def stub_names(stub: Path) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """The names a face's stub imports, each as (module, name in it), and its
    ``__all__``; raises ValueError naming the stub for anything else in it
    (a relative import, a name defined there, an ``__all__`` naming a name it
    does not import)."""
    tree = ast.parse(stub.read_text(), str(stub))
    where: dict[str, tuple[str, str]] = {}
    names: list[str] | None = None
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                where[alias.asname or alias.name] = (node.module, alias.name)
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "__all__"):
            names = list(ast.literal_eval(node.value))
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            raise ValueError(f"{stub}:{node.lineno}: a face's stub holds only absolute "
                             "'from ... import' lines, __all__ and docstrings")
    if names is None:
        raise ValueError(f"{stub}: no __all__")
    missing = sorted(set(names) - set(where))
    if missing:
        raise ValueError(f"{stub}: __all__ names {missing}, which the stub does not import")
    return where, names


def attach(face: str, file: str) -> tuple[Callable[[str], Any], Callable[[], list[str]],
                                          list[str]]:
    """``__getattr__``, ``__dir__`` and ``__all__`` for the face module
    ``face`` (its ``__name__``) at ``file`` (its ``__file__``), from the stub
    beside it. A name's value is kept in the face once imported."""
    where, names = stub_names(Path(file).with_suffix(".pyi"))

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {face!r} has no attribute {name!r}")
        module_name, attr = where[name]
        if module_name == face:  # the face's own submodule
            value = importlib.import_module(f"{face}.{attr}")
        else:
            try:
                value = getattr(importlib.import_module(module_name), attr)
            except AttributeError:  # a submodule not imported yet (``pinned``)
                value = importlib.import_module(f"{module_name}.{attr}")
        setattr(sys.modules[face], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[face])) | set(where))

    return __getattr__, __dir__, names
