"""Native libraries: every failure to build or load one is a
``NativeBuildError`` the caller's Python path survives, said once in the log
(a cache that cannot be written, a compile past its bound, a library that
will not load or lacks its symbol, a source that cannot be written);
``CAPRICORN_REQUIRE_NATIVE=1`` makes each an error instead; the build has
warnings on and as errors."""

from __future__ import annotations

import ctypes
import logging
import shutil
from pathlib import Path

import pytest

from capricorn_jax._src import native
from capricorn_jax._src.native import Library, NativeBuildError, NativeRequiredError

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
SOURCE = 'extern "C" int CapricornAnswer() { return 42; }\n'


@pytest.fixture(autouse=True)
def _fallback_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI sets CAPRICORN_REQUIRE_NATIVE=1; these tests set it themselves."""
    monkeypatch.delenv(native.REQUIRE_ENV, raising=False)


def _configure(lib: ctypes.CDLL) -> None:
    lib.CapricornAnswer.restype = ctypes.c_int


def _library(tmp_path: Path, source: str = SOURCE, **kw) -> Library:
    path = tmp_path / "answer.cc"
    path.write_text(source)
    return Library(path, "answer", "the test's library", "the test's Python path", _configure,
                   **kw)


@needs_cxx
def test_a_library_builds_loads_and_says_so_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CAPRICORN_NATIVE_CACHE", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, "capricorn_jax._src.native")
    lib = _library(tmp_path)
    assert lib.available() and lib.available() and lib.load().CapricornAnswer() == 42
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("the test's library: native (")


@needs_cxx
def test_a_warning_fails_the_build(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPRICORN_NATIVE_CACHE", str(tmp_path / "cache"))
    lib = _library(tmp_path, 'extern "C" int CapricornAnswer() { int unused = 1; return 42; }\n')
    with pytest.raises(NativeBuildError, match="unused"):
        lib.load()
    assert {"-Werror", "-Wall", "-Wextra"} <= set(native.CXX_FLAGS)


def _fails(lib: Library, caplog: pytest.LogCaptureFixture, match: str) -> None:
    """``lib`` falls back (False, twice, one warning naming ``match``)."""
    caplog.set_level(logging.INFO, "capricorn_jax._src.native")
    assert not lib.available() and not lib.available()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "the test's Python path" in warned[0], warned
    assert match in warned[0], warned
    with pytest.raises(NativeBuildError):
        lib.load()


def test_a_cache_that_cannot_be_written_falls_back(tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("")  # a cache under a file: mkdir fails, even for root
    monkeypatch.setenv("CAPRICORN_NATIVE_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(native.shutil, "which", lambda _: "/usr/bin/g++")
    _fails(_library(tmp_path), caplog, "cannot be used")


@needs_cxx
def test_a_compile_past_its_bound_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CAPRICORN_NATIVE_CACHE", str(tmp_path / "cache"))
    slow = tmp_path / "slow-cxx"
    slow.write_text("#!/bin/sh\nexec sleep 5\n")
    slow.chmod(0o755)
    monkeypatch.setenv("CXX", str(slow))
    monkeypatch.setattr(native, "BUILD_TIMEOUT_S", 0.2)
    _fails(_library(tmp_path), caplog, "ran past 0.2s")
    assert not list((tmp_path / "cache").glob("*.so"))  # no half-built file left


def test_a_library_that_will_not_load_falls_back(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not an ELF file")
    monkeypatch.setenv("CAPRICORN_TEST_LIBRARY", str(broken))
    _fails(_library(tmp_path, override_env="CAPRICORN_TEST_LIBRARY"), caplog, "will not load")


@needs_cxx
def test_a_library_without_its_symbol_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CAPRICORN_NATIVE_CACHE", str(tmp_path / "cache"))
    _fails(_library(tmp_path, 'extern "C" int CapricornOther() { return 1; }\n'), caplog,
           "could not be loaded (AttributeError")


def test_a_source_that_cannot_be_written_falls_back(tmp_path, monkeypatch, caplog):
    def source() -> Path:
        raise PermissionError("read-only cache")

    lib = Library(source, "answer", "the test's library", "the test's Python path", _configure)
    _fails(lib, caplog, "PermissionError")


def test_with_the_switch_a_missing_native_library_is_an_error(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"")
    monkeypatch.setenv("CAPRICORN_TEST_LIBRARY", str(broken))
    monkeypatch.setenv(native.REQUIRE_ENV, "1")
    lib = _library(tmp_path, override_env="CAPRICORN_TEST_LIBRARY")
    for _ in range(2):
        with pytest.raises(NativeRequiredError, match="CAPRICORN_REQUIRE_NATIVE=1"):
            lib.available()
    monkeypatch.setenv(native.REQUIRE_ENV, "0")
    assert not lib.available()
