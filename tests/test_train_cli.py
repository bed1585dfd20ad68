"""launch.train as a user runs it: real processes, real jax.distributed."""

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, assert_no_orphans, processes_mentioning, run_train


@pytest.mark.slow
def test_two_hosts_two_devices_train(tmp_path):
    workdir = tmp_path / "run"
    proc = run_train("--hosts=2", "--devices_per_host=2", "--model=tiny", "--steps=12",
                     "--log_every=4", f"--workdir={workdir}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "event" not in r]
    assert [r["step"] for r in steps] == list(range(12))
    for r in steps:
        assert set(r) >= {"step", "loss", "step_time_s", "tokens_per_expert"}
        assert len(r["tokens_per_expert"]) == 2 and len(r["tokens_per_expert"][0]) == 8
        # Kept assignments: 16 sequences * 64 tokens * top-2, minus the dropped ones.
        for layer, dropped in zip(r["tokens_per_expert"], r["dropped"], strict=True):
            assert sum(layer) == 16 * 64 * 2 - dropped
    assert steps[-1]["loss"] < steps[0]["loss"]
    # The console: host 0's progress line every --log_every steps, once per job,
    # no library chatter, and the report.
    progress = [x for x in proc.stdout.splitlines() if "/12 loss " in x]
    assert [x.split(" loss ")[0] for x in progress] == [
        "[host 0] step 4/12", "[host 0] step 8/12", "[host 0] step 12/12"]
    assert "Gloo" not in proc.stdout and "distributed.py" not in proc.stdout
    assert not [x for x in proc.stdout.splitlines() if x.startswith("[host 1]")], proc.stdout
    assert "report:" in proc.stdout
    assert any(r.get("event") == "eval" for r in lines)
    assert_no_orphans(str(workdir))


@pytest.mark.parametrize(
    "flags,flag_name",
    [
        (["--model=tiny", "--expert_parallel=3", "--hosts=3", "--devices_per_host=1"],
         "--expert_parallel"),
        (["--model=nonesuch"], "--model"),
        (["--hosts=0"], "--hosts"),
        (["--hosts=abc"], "--hosts"),
        (["--ckpt=none", "--pec_k=2"], "--pec_k"),
        (["--ckpt=inmem", "--pec_k=9"], "--pec_k"),
        (["--ckpt=inmem", "--pec_policy=load_aware"], "--pec_policy"),
        (["--ckpt=inmem", "--pec_k=2", "--persist_every=2", "--pec_k_persist=4"],
         "--pec_k_persist"),
        (["--ckpt=capricorn", "--replicas=1"], "--replicas"),
        (["--ckpt=pec", "--pec_k=2", "--chunk_path=threaded", "--persist_every=4"],
         "--ckpt=pec --chunk_path=threaded with --persist_every=4"),
        (["--ckpt=gemini", "--profile=every"], "--profile"),
        (["--ckpt=inmem", "--timeline"], "--timeline"),
        (["--kill_every=5"], "--kill_every"),
        (["--resume", "--fresh"], "--fresh"),
    ],
)
def test_bad_flags_give_one_line_error(tmp_path, flags, flag_name):
    proc = run_train(*flags, f"--workdir={tmp_path}", "--steps=2", timeout=60)
    assert proc.returncode != 0
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    assert any(flag_name in line for line in err), proc.stderr
    assert len([line for line in err if flag_name in line]) == 1
    assert_no_orphans(str(tmp_path))


_CHECK_FLAGS = """
import json, sys
from absl import flags
from launch.train import command as train
from launch.train import config
train.define_flags()
out = []
for argv in json.loads(sys.argv[1]):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["train", *argv])
    try:
        config.from_flags(flags.FLAGS)
        out.append(None)
    except config.FlagError as e:
        out.append(str(e))
print(json.dumps(out))
"""


def test_pec_k_persist_flags(tmp_path):
    """--pec_k_persist (2 hosts x 2 devices: 4 expert-parallel ranks by default)."""
    base = [f"--workdir={tmp_path}", "--hosts=2", "--devices_per_host=2", "--ckpt=inmem"]
    cases = {
        ("--pec_k=2", "--persist_every=2", "--pec_k_persist=4"):
            "--pec_k_persist=4 exceeds --pec_k=2",
        ("--pec_k=2", "--persist_every=2", "--pec_k_persist=-1"): "--pec_k_persist=-1 must be",
        ("--persist_every=2", "--pec_k_persist=2"):
            "--pec_k_persist=2 is only used with --pec_k",
        ("--pec_k=4", "--pec_k_persist=4"): "--pec_k_persist=4 is only used with --persist_every",
        ("--pec_k=4", "--persist_every=2", "--pec_k_persist=2"):
            "--pec_k_persist=2 is not a multiple of the expert-parallel size 4",
        ("--pec_k=4", "--persist_every=2", "--pec_k_persist=4"): None,
        ("--pec_k=4", "--persist_every=2", "--pec_k_persist=2", "--expert_parallel=2"): None,
        ("--pec_k=2", "--persist_every=2"): None,  # full persistent steps
        ("--pec_k=8", "--persist_every=2", "--pec_k_persist=8"): None,
    }
    proc = subprocess.run([sys.executable, "-c", _CHECK_FLAGS,
                           json.dumps([base + list(c) for c in cases])],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (flags, want), got in zip(cases.items(), json.loads(proc.stdout), strict=True):
        assert (got is None) if want is None else (got or "").startswith(want), (flags, got)


def test_unwritable_workdir_is_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = run_train(f"--workdir={blocker / 'sub'}", "--steps=2", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--workdir" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_interrupt_stops_every_host(tmp_path):
    workdir = tmp_path / "interrupted"
    log = tmp_path / "supervisor.log"  # a file, not a pipe nobody reads while waiting
    with log.open("w") as out:
        # -X faulthandler: on a hang, SIGABRT dumps every thread's stack into the log.
        proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", "launch.train", "--hosts=2",
             "--devices_per_host=2", "--model=tiny", "--steps=100000", f"--workdir={workdir}"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
        )
    deadline = time.monotonic() + 120
    while len(processes_mentioning(f"--workdir={workdir} --process_id")) < 2:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        pytest.fail("the supervisor did not stop within 60 s of SIGINT:\n"
                    + log.read_text()[-6000:])
    assert code != 0
    assert_no_orphans(str(workdir))


@pytest.mark.slow
def test_supervisor_killed_takes_hosts_with_it(tmp_path):
    workdir = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.train", "--hosts=2", "--devices_per_host=1",
         "--model=tiny", "--steps=100000", f"--workdir={workdir}"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while len(processes_mentioning(f"--workdir={workdir} --process_id")) < 2:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.kill()  # SIGKILL: no cleanup code runs in the supervisor
    proc.wait()
    assert_no_orphans(str(workdir))


def test_checkpoint_config_chunk_cap_and_checks():
    """The config dataclasses check themselves without absl: --chunk_cap_bytes
    defaults to --chunk_bytes, and a check spanning two parts names its flag."""
    from launch.train.config import CheckpointConfig, FlagError
    from models.config import get_config

    base = dict(strategy="capricorn", replicas=2, chunk_bytes=4 << 20, chunk_cap_bytes=0,
                store_root="/tmp", job="job-x", replication_timeout_s=30.0, persist_every=0,
                max_to_keep=3, pec_k=0, pec_policy="sequential", pec_plt_threshold=0.0375,
                pec_dynamic=True, pec_k_persist=0, hosts=2, model=get_config("tiny"),
                expert_axis=4)
    config = CheckpointConfig(**base)
    assert config.chunk_cap == 4 << 20 and config.scheduled and config.in_memory
    assert CheckpointConfig(**{**base, "chunk_cap_bytes": 1 << 20}).chunk_cap == 1 << 20
    assert config.store_dir(1) == config.job_root / "host1"
    with pytest.raises(FlagError, match=r"^--chunk_cap_bytes must be >= 0"):
        CheckpointConfig(**{**base, "chunk_cap_bytes": -1})
    with pytest.raises(FlagError, match=r"^--replicas=3 must be in \[1, --hosts=2\]"):
        CheckpointConfig(**{**base, "strategy": "inmem", "replicas": 3})
    assert CheckpointConfig(**{**base, "budget_s": 0.5}).budget_s == 0.5
    with pytest.raises(FlagError, match=r"^--ckpt_budget bounds the in-memory tier"):
        CheckpointConfig(**{**base, "strategy": "blocking", "budget_s": 0.5})
    with pytest.raises(FlagError, match=r"^--ckpt_budget must be -1 \(none\) or in \[0, 60\]"):
        CheckpointConfig(**{**base, "budget_s": -0.5})


def test_different_work_names_each_step_where_strategies_disagree():
    from launch.metrics import different_work

    same = {"3": {"none": 5.25, "inmem": 5.25}, "4": {"none": 5.0}}
    assert different_work(same) == []
    differ = {**same, "10": {"none": 4.5, "pec": 4.75}, "9": {"a": 1.0, "b": 2.0}}
    assert different_work(differ) == ["step 9: a 1.0, b 2.0", "step 10: none 4.5, pec 4.75"]


def test_the_console_reports_a_repartition_only_when_the_schedule_moved(monkeypatch):
    from launch.train import command as train

    said = []
    monkeypatch.setattr(train.logging, "info", lambda fmt, *args: said.append(fmt % args))
    event = {"strategy": "capricorn", "step": 1, "window_bytes": [10, 20], "tail_bytes": 5}
    last = train._repartition(0, event, None)
    last = train._repartition(0, {**event, "step": 2}, last)  # the same bytes: not news
    last = train._repartition(0, {**event, "step": 3, "window_bytes": [15, 15]}, last)
    assert said == ["host 0: capricorn re-partitioned after step 1: 30 bytes in windows, 5 in "
                    "the tail",
                    "host 0: capricorn re-partitioned after step 3: 30 bytes in windows, 5 in "
                    "the tail"]


def test_one_job_per_workdir_and_a_symlinked_workdir_is_the_same_job(tmp_path):
    from launch.train.config import job_name
    from launch.train.supervisor import workdir_lock
    from launch.train.workdir_lock import WorkdirInUse

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    assert job_name(str(tmp_path / "link")) == job_name(str(real))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[2]); "
         "from launch.train.supervisor import workdir_lock\n"
         "with workdir_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)",
         str(real), str(ROOT)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkdirInUse, match=rf"--workdir {tmp_path / 'link'} is in use by "
                                               rf"another job \(job '.*', supervisor, pid "
                                               rf"{holder.pid} on "):
            with workdir_lock(str(tmp_path / "link")):
                pass
    finally:
        holder.kill()
        holder.wait(30)
    with workdir_lock(str(real)):  # released with its holder
        pass
