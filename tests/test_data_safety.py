"""No checkpoint deleted behind the user's back, and the console a user sees.

Fast: ``prepare_workdir`` on a workdir laid out as a finished job leaves it
(resume, the default) or deletes it with one line per thing (``--fresh``);
``--resume`` with nothing says so; the ``Console`` filter on recorded lines.
Slow (real processes): re-running a finished command resumes from its
checkpoints; ``--fresh`` starts over; a worker failing on its own still
prints its traceback.
"""

import json
import types

import pytest

from capricorn_jax._src.memory.store.head_seal import seal
from launch.cluster.console import Console
from launch.train.config import CheckpointConfig
from launch.train.supervisor import prepare_workdir, report
from models.config import get_config
from tests.helpers import assert_no_orphans, run_train


def _config(workdir, store_root, fresh=False, resume=False):
    checkpoint = CheckpointConfig(
        strategy="inmem", replicas=2, chunk_bytes=4 << 20, chunk_cap_bytes=0,
        store_root=str(store_root), job="job-x", replication_timeout_s=30.0, persist_every=0,
        max_to_keep=3, pec_k=0, pec_policy="sequential", pec_plt_threshold=0.0375,
        pec_dynamic=True, pec_k_persist=0, hosts=2, model=get_config("tiny"), expert_axis=4)
    train = types.SimpleNamespace(workdir=str(workdir), fresh=fresh, resume=resume)
    return types.SimpleNamespace(train=train, checkpoint=checkpoint)


def _finished_job(tmp_path):
    """A workdir and RAM store as a finished job leaves them."""
    work, shm = tmp_path / "w", tmp_path / "shm"
    for step in (4, 8):
        (work / "checkpoints" / str(step) / "state").mkdir(parents=True)
    (work / "checkpoints" / "8" / "state" / "data").write_bytes(b"x" * 10)
    for host in (0, 1):
        owner = shm / "job-x" / f"host{host}" / f"owner{host}"
        owner.mkdir(parents=True)
        for slot, step in enumerate((7, 8)):
            (owner / f"slot{slot}.head").write_text(json.dumps(seal({"step": step,
                                                                         "generation": 1})))
            (owner / f"slot{slot}.data").write_bytes(b"y" * 100)
    (work / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n\n')
    return work, shm


def test_default_resumes_and_deletes_nothing(tmp_path, capsys):
    work, shm = _finished_job(tmp_path)
    before = sorted(p for p in tmp_path.rglob("*"))
    prepare_workdir(_config(work, shm))
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert capsys.readouterr().out.splitlines() == [
        f"resume: found persistent checkpoints {work / 'checkpoints'} (2 steps (4, 8)); "
        f"RAM stores {shm / 'job-x'} (2 steps (7, 8) on 2 hosts, "
        f"{sum(p.stat().st_size for p in shm.rglob('slot*'))} bytes); "
        f"resuming from the newest (--fresh deletes them and starts over)"]


def test_fresh_deletes_and_says_what(tmp_path, capsys):
    work, shm = _finished_job(tmp_path)
    prepare_workdir(_config(work, shm, fresh=True))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"fresh: deleted persistent checkpoints {work / 'checkpoints'} "
                        f"(2 steps (4, 8))")
    assert lines[1].startswith(f"fresh: deleted RAM stores {shm / 'job-x'} (2 steps (7, 8) "
                               f"on 2 hosts, ")
    assert lines[2] == f"fresh: deleted metrics {work / 'metrics.jsonl'} (2 records)"
    assert len(lines) == 3
    assert sorted(p.name for p in work.iterdir()) == [] and not (shm / "job-x").exists()
    prepare_workdir(_config(work, shm, fresh=True))
    assert capsys.readouterr().out.splitlines() == [f"fresh: nothing to delete in {work}"]


def test_resume_with_nothing_says_so(tmp_path, capsys):
    prepare_workdir(_config(tmp_path / "w", tmp_path / "shm", resume=True))
    assert capsys.readouterr().out.splitlines() == [
        f"resume: nothing to resume in {tmp_path / 'w'} (no checkpoint); starting from step 0"]
    prepare_workdir(_config(tmp_path / "w", tmp_path / "shm"))  # a new workdir: silent
    assert capsys.readouterr().out == ""


def test_metrics_without_checkpoints_are_kept_and_appended_to(tmp_path, capsys):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "metrics.jsonl").write_text('{"step": 0}\n')
    prepare_workdir(_config(tmp_path / "w", tmp_path / "shm"))
    assert (tmp_path / "w" / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert capsys.readouterr().out.splitlines() == [
        f"resume: nothing to resume in {tmp_path / 'w'} (no checkpoint); starting from step 0; "
        f"appending to metrics.jsonl"]


ABSL = "I1201 03:25:43.470851 140055608216448 {}:{}] {}"


def _feed(console, lines):
    for host, line in lines:
        console.line(host, line + "\n")


def test_console_shows_the_job_and_hides_library_chatter():
    out = []
    console = Console(write=out.append)
    _feed(console, [
        (0, ABSL.format("distributed.py", 149, "Starting JAX distributed service")),
        (0, ABSL.format("command.py", 111, "host 0/2: 2 local devices")),
        (1, ABSL.format("command.py", 111, "host 1/2: 2 local devices")),
        (0, "[Gloo] Rank 0 is connected to 1 peer ranks."),
        (1, "3 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"),
        (1, " peer ranks. Expected number of connected peer ranks is : 3"),  # split by threads
        (1, "[Gloo] Rank 12 is connected to 1"),
        (1, "0"),  # a rank number cut off between two threads' writes
        (1, "12 "),
        (0, "ed t"),
        (1, "/x/jax/_src/foo.py:12: UserWarning: something"),
        (1, "  warnings.warn("),
        (0, ABSL.format("command.py", 187, "step 10/60 loss 5.1")),
        (1, ABSL.format("command.py", 187, "step 10/60 loss 5.1")),
        (0, "W1201 03:25:43.470851 1 checkpoint_manager_orbax.py:9] orbax says"),
        (1, "W1201 03:25:43.470851 1 recovery.py:207] host 1: version 8 fails its checksums"),
        (0, "E1201 03:25:43.470851 1 gloo.cc:9] an error"),
        (0, "a plain print"),
        (1, ""), (1, "   "),  # empty lines say nothing
        (1, "fault: host 1 paused after step 30 (its fault point)"),
    ])
    assert out[-1] == "[host 1] fault: host 1 paused after step 30 (its fault point)\n"
    out.pop()
    assert out == ["[host 0] host 0/2: 2 local devices\n", "[host 0] step 10/60 loss 5.1\n",
                   "[host 1] WARNING: host 1: version 8 fails its checksums\n",
                   "[host 0] ERROR: an error\n", "[host 0] a plain print\n"]
    verbose = []
    console = Console(verbose=True, write=verbose.append)
    _feed(console, [(1, "[Gloo] x"), (1, "Traceback (most recent call last):")])
    console.ended(1)
    assert verbose == ["[host 1] [Gloo] x\n", "[host 1] Traceback (most recent call last):\n"]


TRACEBACK = [ABSL.format("runtime.py", 78, "worker failed").replace("I", "E", 1),
             "Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
             "RuntimeError: boom"]


def test_console_after_an_injected_kill_says_one_line_per_survivor():
    out = []
    console = Console(write=out.append)
    console.injected_kill((1,))
    _feed(console, [
        (0, ABSL.format("command.py", 187, "step 30/60 loss 4.2")), (0, "[Gloo] connection closed"),
        (0, "E1201 03:25:43.470851 1 gloo.cc:9] peer gone"), (1, "exited with code -9"),
        *[(0, line) for line in TRACEBACK]])
    console.ended(1)
    console.ended(0)
    assert out == ["[host 0] step 30/60 loss 4.2\n", "[host 1] exited with code -9\n",
                   "[host 0] stopped after host 1 was killed (its error output: --verbose)\n"]
    console.attempt()  # the next attempt: a genuine failure is shown in full
    _feed(console, [(0, line) for line in TRACEBACK])
    console.ended(0)
    assert out[3:] == [f"[host 0] {line}\n" for line in TRACEBACK]


@pytest.mark.slow
@pytest.mark.parametrize("steps, line", [
    ([0, 1, 2, 3, 0, 1], "recovery: no version every host could restore; the job started over "
                         "from step 0 (2 steps run again)"),
    ([0, 1, 2, 3], "recovery: none happened"),
])
def test_the_report_says_a_job_that_restarted_from_nothing_started_over(tmp_path, capsys,
                                                                         steps, line):
    """An injected fault whose job restored nothing (no version on every
    host: ``blocking`` after a machine loss) ran its steps again from step 0:
    the report says so, not that no recovery happened."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0, "step_time_s": 0.1}) + "\n"
                            for s in steps))
    report(path, injected=True)
    assert capsys.readouterr().out.splitlines()[-1] == line


@pytest.mark.slow  # four launches of a 2-host job
@pytest.mark.multiprocess
def test_rerun_resumes_and_fresh_starts_over(tmp_path):
    work, shm = tmp_path / "w", tmp_path / "shm"
    cmd = ("--hosts=2", "--devices_per_host=2", "--model=tiny", "--steps=6", "--ckpt=inmem",
           "--eval_sequences=0", "--log_every=3", f"--workdir={work}", f"--store_root={shm}")

    def records():
        return [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]

    first = run_train(*cmd, timeout=400)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "resume:" not in first.stdout and "fresh:" not in first.stdout
    assert [r["step"] for r in records() if "event" not in r] == list(range(6))
    store = sorted(p.name for p in shm.rglob("*.head"))
    assert store

    again = run_train(*cmd, timeout=400)  # the same command again: resumes, runs no step
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.splitlines()[0].startswith("resume: found RAM stores ")
    rerun = records()
    assert [r["step"] for r in rerun if "event" not in r] == list(range(6))
    recoveries = [r for r in rerun if r.get("event") == "recovery"]
    assert [(r["step"], r["tier"]) for r in recoveries] == [(6, "local")]
    assert "[host 0] recovery: resumed from step 6 via tier local" in again.stdout
    assert sorted(p.name for p in shm.rglob("*.head"))  # still there

    with_resume = run_train(*cmd, "--resume", "--fresh", timeout=60)
    assert with_resume.returncode == 2 and "--fresh" in with_resume.stderr
    assert with_resume.stderr.strip().count("\n") == 0, with_resume.stderr

    fresh = run_train(*cmd, "--fresh", timeout=400)
    assert fresh.returncode == 0, fresh.stdout[-3000:] + fresh.stderr[-3000:]
    said = fresh.stdout.splitlines()
    assert said[0].startswith(f"fresh: deleted RAM stores {shm / 'job-'}")
    assert said[1] == f"fresh: deleted metrics {work / 'metrics.jsonl'} ({len(rerun)} records)"
    new = records()
    assert [r["step"] for r in new if "event" not in r] == list(range(6))
    assert not [r for r in new if r.get("event") == "recovery"]
    assert_no_orphans(str(work))


@pytest.mark.slow
def test_a_worker_failing_on_its_own_prints_its_traceback(tmp_path):
    """A host whose store cannot be created fails by itself: its traceback is shown."""
    proc = run_train("--hosts=2", "--devices_per_host=1", "--model=tiny", "--steps=2",
                     "--ckpt=inmem", "--eval_sequences=0", f"--workdir={tmp_path / 'w'}",
                     "--store_root=/proc/no_such_store", timeout=300)
    assert proc.returncode != 0
    assert "[host 0] Traceback (most recent call last):" in proc.stdout, proc.stdout[-3000:]
    assert "stopped after host" not in proc.stdout
    assert_no_orphans(str(tmp_path / "w"))
