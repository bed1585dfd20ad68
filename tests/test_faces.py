"""The faces' names, imported on first use (``capricorn_jax._faces``): every
name of every face resolves to what its stub says; importing a face, or a
launcher's supervisor, imports no JAX; a bad stub is refused naming it."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from capricorn_jax import _faces
from tests.helpers import HEAVY, ROOT, child_env

FACES = ("capricorn_jax", "capricorn_jax.experimental",
         *(f"capricorn_jax.experimental.{m}" for m in ("measuring", "multihost", "planning",
                                                       "profiling", "store", "strategies",
                                                       "testing")))


@pytest.mark.parametrize("face", FACES)
def test_every_name_of_a_face_is_the_object_its_stub_names(face):
    module = importlib.import_module(face)
    where, names = _faces.stub_names(Path(module.__file__).with_suffix(".pyi"))
    assert module.__all__ == names and set(names) <= set(dir(module))
    for name, (source, attr) in where.items():
        got, origin = getattr(module, name), importlib.import_module(source)
        assert got is getattr(origin, attr), (face, name)  # a submodule: set on its package
    with pytest.raises(AttributeError, match=f"module '{face}' has no attribute 'nope'"):
        module.nope  # noqa: B018


# In a fresh interpreter: the faces, the options a launcher checks its flags
# with, and the launchers' command modules import; none of HEAVY does.
_NOTHING_HEAVY = """
import importlib, sys
for m in sys.argv[2:]:
    importlib.import_module(m)
import capricorn_jax, capricorn_jax.experimental as e
capricorn_jax.InMemoryOptions, capricorn_jax.DetectorOptions, e.CacheOptions, e.HostStore
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1].split(",")))
assert heavy == [], heavy
"""


def test_the_faces_and_the_launchers_import_no_jax():
    modules = [*FACES, "capricorn_jax.stores", "models", "launch.train.command",
               "launch.train.supervisor", "launch.cli_flags"]
    done = subprocess.run([sys.executable, "-c", _NOTHING_HEAVY, ",".join(HEAVY), *modules],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_name_is_imported_on_first_use_and_kept(tmp_path, monkeypatch):
    pkg = tmp_path / "lazyface_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from capricorn_jax._faces import attach\n"
        "__getattr__, __dir__, __all__ = attach(__name__, __file__)\n")
    (pkg / "__init__.pyi").write_text(
        '"""A face."""\nfrom lazyface_pkg.heavy import Thing as Renamed\n'
        "from lazyface_pkg import sub\n__all__ = ['Renamed', 'sub']\n")
    (pkg / "heavy.py").write_text("class Thing:\n    pass\n")
    (pkg / "sub.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    face = importlib.import_module("lazyface_pkg")
    assert "lazyface_pkg.heavy" not in sys.modules and face.__all__ == ["Renamed", "sub"]
    thing = face.Renamed
    assert "lazyface_pkg.heavy" in sys.modules and thing.__name__ == "Thing"
    assert vars(face)["Renamed"] is thing  # kept: the next access is a plain attribute
    assert face.sub.X == 1  # a submodule the stub names, imported on first use
    assert {"Renamed", "sub"} <= set(dir(face))


@pytest.mark.parametrize("text, error", [
    ("from .heavy import Thing\n__all__ = ['Thing']\n", "only absolute 'from ... import'"),
    ("from m import a\nX = 1\n__all__ = ['a']\n", "stub.pyi:2: a face's stub holds only"),
    ("from m import a\n", "no __all__"),
    ("from m import a\n__all__ = ['a', 'b']\n", r"__all__ names \['b'\], which the stub"),
])
def test_a_bad_stub_is_refused_naming_it(tmp_path, text, error):
    stub = tmp_path / "stub.pyi"
    stub.write_text(text)
    with pytest.raises(ValueError, match=error):
        _faces.stub_names(stub)
