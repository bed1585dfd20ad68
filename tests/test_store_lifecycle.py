"""The stores' lifecycle: the live-job lock, the bound on the RAM disk with its
error, pages reserved when a slot grows, the release after a clean finish, and
listing and pruning the jobs' stores (capricorn_jax.stores)."""

from __future__ import annotations

import errno
import fcntl
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import capricorn_jax
from capricorn_jax import stores
from capricorn_jax import stores as store_admin
from capricorn_jax._src.memory.store import store_lifecycle as store_lib
from capricorn_jax._src.memory.store.store import HostStore, StoreLockUnsupported
from capricorn_jax._src.memory.store.store_lifecycle import (
    StoreFullError,
    StoreLimit,
    committed_steps,
    mount_point,
    remove_unused,
    store_in_use,
    tree_bytes,
)

# store_lifecycle.py alone (the standard library; not the package, which imports JAX) in a
# second process: prints whether it sees the store at argv[2] in use.
_PROBE = ("import importlib.util, sys; "
          "spec = importlib.util.spec_from_file_location('s', sys.argv[1]); "
          "m = sys.modules['s'] = importlib.util.module_from_spec(spec); "
          "spec.loader.exec_module(m); "
          "print(m.store_in_use(sys.argv[2]))")


def _in_use_elsewhere(root: Path) -> bool:
    out = subprocess.run([sys.executable, "-c", _PROBE, store_lib.__file__, str(root)],
                         capture_output=True, text=True, check=True, timeout=60)
    return {"True\n": True, "False\n": False}[out.stdout]


def _commit(store: HostStore, owner: int, step: int, nbytes: int = 4096) -> None:
    w = store.begin(owner, step, nbytes)
    w.write_chunk("d0.c0", bytes(nbytes), offset=0)
    w.commit({"fingerprint": "x"})


# ------------------------------------------------------------------ the lock


def test_an_open_store_is_in_use_for_another_process_until_closed(tmp_path):
    root = tmp_path / "job" / "host0"
    assert not store_in_use(root)  # no store yet: no lock file
    store = HostStore(root)
    assert (root / ".lock").is_file()
    assert store_in_use(root) and _in_use_elsewhere(root)
    store.wipe()  # a lost machine's RAM: the lock survives it
    assert sorted(p.name for p in root.iterdir()) == [".lock"]
    assert _in_use_elsewhere(root)
    store.close()
    assert not store_in_use(root) and not _in_use_elsewhere(root)


def test_two_store_objects_of_one_root_share_the_lock(tmp_path):
    first, second = HostStore(tmp_path / "h0"), HostStore(tmp_path / "h0")
    first.close()
    assert store_in_use(tmp_path / "h0")  # the second still holds it
    second.close()
    assert not store_in_use(tmp_path / "h0")


def test_remove_unused_refuses_a_store_in_use(tmp_path):
    store = HostStore(tmp_path / "job" / "host0")
    _commit(store, 0, 1)
    assert not remove_unused(tmp_path / "job")
    assert store.versions(0) == [1]  # nothing deleted
    store.close()
    assert remove_unused(tmp_path / "job") and not (tmp_path / "job").exists()
    assert remove_unused(tmp_path / "job")  # already gone


def test_partials_and_walks_ignore_the_lock(tmp_path):
    store = HostStore(tmp_path / "h0")
    _commit(store, 0, 1, nbytes=1000)
    assert store.owners() == [0] and store.bytes_held() == 1024
    store.close()
    again = HostStore(tmp_path / "h0")
    assert again.removed_partials == [] and again.versions(0) == [1]
    again.close()


# ------------------------------------------------------------------ the bound


def test_a_version_over_the_bound_raises_store_full_naming_everything(tmp_path):
    """The bound is on the RAM disk's bytes in use (statvfs): a store whose
    limit the disk already passes refuses to grow, and says why."""
    shared = tmp_path.resolve()
    roomy = HostStore(shared / "job" / "host1", limit=StoreLimit(shared, max_bytes=1 << 62))
    _commit(roomy, 1, 1, nbytes=8192)  # within the bound
    roomy.close()
    store = HostStore(shared / "job" / "host0", limit=StoreLimit(shared, max_bytes=1))
    with pytest.raises(StoreFullError) as info:
        store.begin(0, 2, 4096)
    e = info.value
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC
    st = os.statvfs(shared)
    size, msg = st.f_blocks * st.f_frsize, str(e)
    assert f"RAM disk {mount_point(shared)} cannot hold" in msg
    assert re.search(r"the RAM disk would have \d+ bytes in use, over the bound of 1\.", msg)
    assert f"{shared / 'job' / 'host0' / 'owner0' / 'slot0.data'} needs 4096 more bytes" in msg
    assert f"the RAM disk is {size / (1 << 20):.1f} MiB ({size} bytes) with " in msg
    assert re.search(r"free and [\d.]+ MiB \(\d+ bytes\) in use; ", msg)
    assert "the bound is 0.0 MiB (1 bytes) in use" in msg
    assert f"python -m capricorn_jax.stores --store_root={shared} " in msg
    # The refused slot is free again, and no file grew.
    owner = shared / "job" / "host0" / "owner0"
    assert sorted(p.name for p in owner.iterdir()) == ["slot0.data"]
    assert os.path.getsize(owner / "slot0.data") == 0
    # A slot growing chunk by chunk is bounded too.
    writer = store.begin(0, 2)
    with pytest.raises(StoreFullError):
        writer.write_chunk("d0.c0", bytes(4096))
    writer.abort()
    store.close()


def test_a_version_over_the_free_space_raises_store_full(tmp_path):
    shared = tmp_path.resolve()
    store = HostStore(shared / "h0", limit=StoreLimit(shared, max_bytes=1 << 62))
    st = os.statvfs(shared)
    free = st.f_bavail * st.f_frsize
    with pytest.raises(StoreFullError, match=r"\d+ bytes wanted, \d+ free"):
        store.begin(0, 1, free + (1 << 30))
    store.close()


def test_fraction_of_the_ram_disk(tmp_path):
    st = os.statvfs(tmp_path)
    limit = StoreLimit.fraction_of(tmp_path / "s", 0.5)
    assert limit == StoreLimit((tmp_path / "s").resolve(), int(0.5 * st.f_blocks * st.f_frsize))
    for bad in (0, -0.1, 1.01):
        with pytest.raises(ValueError, match=f"max_store_fraction must be in \\(0, 1\\], "
                                             f"got {bad}"):
            capricorn_jax.InMemoryOptions(store_root=str(tmp_path), job="j",
                                          max_store_fraction=bad)
    assert capricorn_jax.InMemoryOptions(str(tmp_path), "j", max_store_fraction=1.0)


# ------------------------------------------------------------------ pages reserved


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_grown_slot_has_its_pages_on_the_ram_disk():
    root = Path(tempfile.mkdtemp(prefix="capricorn-lifecycle-", dir="/dev/shm"))
    try:
        store = HostStore(root / "h0")
        store.begin(0, 1, 1 << 20).abort()
        data = root / "h0" / "owner0" / "slot0.data"
        assert data.stat().st_size == 1 << 20
        assert data.stat().st_blocks * 512 >= 1 << 20
        plain = root / "truncated"  # what an ftruncate alone leaves: no page yet
        with open(plain, "wb") as f:
            os.ftruncate(f.fileno(), 1 << 20)
        assert plain.stat().st_blocks == 0
        store.close()
    finally:
        shutil.rmtree(root)


def test_enospc_from_fallocate_shrinks_back_and_raises(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    store = HostStore(tmp_path / "job" / "h0")
    _commit(store, 0, 1, nbytes=4096)
    store.remove(0, 1)
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(StoreFullError, match="posix_fallocate of 4096 bytes failed: No space "
                                             "left on device") as info:
        store.begin(0, 2, 8192)
    assert "python -m capricorn_jax.stores --store_root=" in str(info.value)
    assert os.path.getsize(tmp_path / "job" / "h0" / "owner0" / "slot0.data") == 4096
    assert not (tmp_path / "job" / "h0" / "owner0" / "slot0.writing").exists()
    store.close()


def test_no_fallocate_on_the_filesystem_falls_back_to_ftruncate(tmp_path, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    store = HostStore(tmp_path / "h0")
    _commit(store, 0, 1, nbytes=4096)
    assert store.read_chunk(0, 1, "d0.c0") == bytes(4096)
    store.close()


# ------------------------------------------------------------------ release


@pytest.fixture(scope="module")
def trainer():
    from launch.trainer import OptimizerOptions, Trainer, make_mesh
    from models import get_config

    return Trainer(get_config("tiny"), make_mesh(4), OptimizerOptions())


def _checkpointer(trainer, store_root: Path):
    opts = capricorn_jax.InMemoryOptions(store_root=str(store_root), job="j", replicas=1,
                                         chunk_bytes=1 << 16)
    return capricorn_jax.InMemoryCheckpointer(opts, trainer.mesh, trainer.abstract_state,
                                              trainer.state_shardings, 0, 1)


def _save(ckpt, state, steps) -> None:
    for step in steps:
        ckpt.save(step, state, {"data": {"step": step}})
        ckpt.wait_until_finished(60)


def test_release_final_keeps_the_final_version_alone(trainer, tmp_path):
    ckpt, state = _checkpointer(trainer, tmp_path), trainer.init_state(0)
    st = os.statvfs(tmp_path)
    assert ckpt.store.limit == StoreLimit(tmp_path.resolve(),
                                          int(0.8 * st.f_blocks * st.f_frsize))
    root = tmp_path / "j" / "host0"
    with pytest.raises(ValueError, match="keep must be 'none' or 'final', got 'all'"):
        ckpt.release("all")
    _save(ckpt, state, range(1, 6))
    with pytest.raises(RuntimeError, match=r"release\('final'\) before close\(\)"):
        ckpt.release("final")
    ckpt.close()
    assert ckpt.store.versions(0) == [3, 4, 5]  # the safe version lags the last save
    slots = sorted(p.name for p in (root / "owner0").glob("*.data"))
    before = ckpt.store.bytes_held()
    done = ckpt.release("final")
    reader = HostStore(root)
    slot = reader.manifest(0, 5)["slot"]
    reader.close()
    assert done.keep == "final" and done.versions == {0: [5]}
    assert sorted(p.name for p in root.iterdir()) == [".lock", "owner0"]
    assert sorted(p.name for p in (root / "owner0").iterdir()) == [f"slot{slot}.data",
                                                                  f"slot{slot}.head"]
    held = os.path.getsize(root / "owner0" / f"slot{slot}.data")
    assert done.bytes_held == held and done.bytes_freed == before - held
    assert len(slots) > 1 and before == held * len(slots)  # equal slots, one left
    assert not store_in_use(root)  # released: closed
    assert committed_steps(root) == {0: [5]}
    _, recovered = capricorn_jax.recover(again := _checkpointer(trainer, tmp_path))
    assert recovered.step == 5  # a later resume still finds it
    again.close()


def test_release_none_deletes_the_store_and_the_empty_job(trainer, tmp_path):
    ckpt, state = _checkpointer(trainer, tmp_path), trainer.init_state(0)
    _save(ckpt, state, range(1, 4))
    ckpt.close()
    before = ckpt.store.bytes_held()
    done = ckpt.release("none")
    assert done.keep == "none" and done.versions == {} and done.bytes_held == 0
    assert done.bytes_freed == before > 0
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == []


def test_release_none_leaves_the_job_while_another_host_store_is_there(trainer, tmp_path):
    other = HostStore(tmp_path / "j" / "host1")
    ckpt = _checkpointer(trainer, tmp_path)
    _save(ckpt, trainer.init_state(0), [1])
    ckpt.close()
    ckpt.release("none")
    assert sorted(p.name for p in (tmp_path / "j").iterdir()) == ["host1"]
    other.close()


# ------------------------------------------------------------------ list and prune


def _job(root: Path, name: str, hosts: int, steps: list[int], age_h: float = 0.0,
         keep_open: bool = False) -> list[HostStore]:
    opened = []
    for h in range(hosts):
        store = HostStore(root / name / f"host{h}")
        for step in steps:
            _commit(store, h, step)
        if keep_open:
            opened.append(store)
        else:
            store.close()
    if age_h:
        when = time.time() - age_h * 3600
        for directory, dirs, files in os.walk(root / name):
            for entry in (*dirs, *files, "."):
                os.utime(os.path.join(directory, entry), (when, when))
    return opened


def test_list_and_prune_jobs(tmp_path):
    root = tmp_path / "stores"
    _job(root, "old", 2, [1, 2], age_h=48)
    live = _job(root, "live", 1, [7], keep_open=True)
    _job(root, "new", 1, [3])
    sizes = {name: tree_bytes(root / name) for name in ("old", "live", "new")}
    assert sizes["old"] > 4 * 4096  # four slots of 4096 bytes, their heads, the locks

    jobs = {j.job: j for j in store_admin.list_jobs(root)}
    assert list(jobs) == ["live", "new", "old"]
    assert jobs["old"].hosts == {0: {0: [1, 2]}, 1: {1: [1, 2]}}
    assert [jobs[n].in_use for n in ("live", "new", "old")] == [True, False, False]
    assert {n: j.bytes for n, j in jobs.items()} == sizes
    assert time.time() - jobs["old"].last_use > 47 * 3600
    now = time.time()
    lines = store_admin.listing(root, now)
    assert lines[0].startswith(f"live: 1 host (host0: owner0 v7), 0.0 MiB "
                               f"({sizes['live']} bytes), last use ")
    assert lines[0].endswith(", in use")
    assert lines[2].startswith(f"old: 2 hosts (host0: owner0 v1,2; host1: owner1 v1,2), "
                               f"0.0 MiB ({sizes['old']} bytes), last use ")
    assert "(48.0 h ago)" in lines[2] and not lines[2].endswith("in use")
    disk, size, free = store_admin.ram_disk(root)
    assert lines[3].startswith(f"total: 3 jobs, 0.0 MiB ({sum(sizes.values())} bytes) under "
                               f"{root}; RAM disk {disk}: ")

    # No persistent step is known for these jobs: they may restart from their
    # stores, so only --force deletes them.
    result = store_admin.prune(root, older_than_h=24)
    assert (result.deleted, result.in_use, result.missing) == ([], [], [])
    assert result.kept == [("old", "it may restart from them (newest in-memory version 2, no "
                                   "persistent directory recorded)")]
    result = store_admin.prune(root, older_than_h=24, force=True)
    assert (result.deleted, result.in_use, result.missing) == ([("old", sizes["old"])], [], [])
    result = store_admin.prune(root, everything=True, force=True)
    assert (result.deleted, result.in_use, result.missing) == ([("new", sizes["new"])],
                                                                ["live"], [])
    assert sorted(p.name for p in root.iterdir()) == ["live"]
    assert live[0].versions(0) == [7]  # untouched
    with pytest.raises(ValueError, match="prune needs a job name"):
        store_admin.prune(root)
    with pytest.raises(ValueError, match="bad job name '..'"):
        store_admin.prune(root, jobs=[".."])
    live[0].close()


def test_the_command_prints_one_line_per_job_and_fails_on_a_missing_job(tmp_path):
    root = tmp_path / "stores"
    _job(root, "a", 1, [1])
    live = _job(root, "b", 1, [2], keep_open=True)
    size = tree_bytes(root / "a")
    out = io.StringIO()
    assert stores.run(str(root), "list", None, None, False, out) == 0
    listed = out.getvalue().splitlines()
    assert [line.split(":")[0] for line in listed] == ["a", "b", "total"]
    out = io.StringIO()
    assert stores.run(str(root), "prune", "b", None, False, out) == 0
    assert out.getvalue() == "prune: skipped b: in use (a process holds its store open)\n"
    out = io.StringIO()
    assert stores.run(str(root), "prune", "a", None, False, out) == 0
    assert out.getvalue() == ("prune: kept a: it may restart from them (newest in-memory version "
                              "1, no persistent directory recorded); --force deletes it\n")
    out = io.StringIO()
    assert stores.run(str(root), "prune", "a", None, False, out, force=True) == 0
    assert out.getvalue() == f"prune: deleted a (0.0 MiB, {size} bytes freed)\n"
    out = io.StringIO()
    assert stores.run(str(root), "prune", "a", None, False, out) == 1
    assert out.getvalue() == f"prune: no job 'a' under {root}\n"
    assert stores.run(str(root), "prune", None, None, False, io.StringIO()) == 2
    assert stores.run(str(root), "list", "a", None, False, io.StringIO()) == 2
    live[0].close()
    assert store_admin.default_store_root().endswith("capricorn_jax")


def test_prune_keeps_a_job_newer_than_its_persistent_step_unless_forced(tmp_path):
    """A job whose stores hold version 7: with persistent step 5 recorded it may
    restart from them (kept); once step 7 is committed they hold nothing newer
    (deleted); an uncommitted (temporary) step 9 does not count."""
    root, persistent = tmp_path / "stores", tmp_path / "ckpt"
    _job(root, "j", 1, [7])
    store_admin.record_persistent(root / "j", persistent)
    for name in ("5", "9.orbax-checkpoint-tmp"):
        (persistent / name).mkdir(parents=True)
    assert store_admin.newest_persistent_step(root / "j") == (5, str(persistent))
    result = store_admin.prune(root, jobs=["j"])
    assert result.deleted == [] and result.kept == [
        ("j", f"it may restart from them (newest in-memory version 7, newest persistent step 5 "
              f"in {persistent})")]
    (persistent / "7").mkdir()
    size = tree_bytes(root / "j")
    assert store_admin.prune(root, jobs=["j"]).deleted == [("j", size)]


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL])
def test_a_store_root_without_flock_is_a_named_refusal(tmp_path, monkeypatch, code):
    def no_flock(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(StoreLockUnsupported, match=rf"cannot lock {tmp_path}/h0/\.lock: "
                                                    rf"{errno.errorcode[code]} .* needs a working "
                                                    rf"flock on its store root"):
        HostStore(tmp_path / "h0")
