"""launch.bench runs strategies side by side and never reports a failed run."""

import json
import subprocess
import sys

import pytest

from launch.bench.records import idle_outside_collectives
from launch.cluster import cpu_account
from tests.helpers import ROOT, assert_no_orphans, run_launcher

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # every test here starts processes


def _bench(*flags, timeout=400):
    """``python -m launch.bench FLAGS``; its parent imports no JAX unless it
    measures the copy bandwidth."""
    return run_launcher("launch.bench", *flags, timeout=timeout,
                        light="--bandwidth_mib=0" in flags)


def test_bench_reports_every_strategy(tmp_path):
    out = tmp_path / "bench.json"
    # orbax_async right before orbax_emergency: two Orbax managers in one
    # process, the first one's last async save still finalizing (the sequence
    # that once collided on a shared barrier name).
    proc = _bench("--strategies=none,blocking,blocking_disk,orbax_async,orbax_emergency,inmem,pec",
                  "--model=tiny", "--dispatch=fixed", "--steps=3", "--reps=2", "--persist_every=2",
                  "--warmup=2", f"--store_root={tmp_path / 'shm'}", f"--workdir={tmp_path / 'w'}",
                  f"--json={out}", f"--png={tmp_path / 'bench.png'}", "--bandwidth_mib=8")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    result = report["strategies"]
    assert set(result) == {"none", "blocking", "blocking_disk", "orbax_async", "orbax_emergency",
                           "inmem", "pec"}
    assert report["command"].startswith("python -m launch.bench --strategies=none,blocking,")
    assert "CPU" in report["machine"] and "jax" in report["machine"]
    bandwidth = report["bandwidth"]
    assert bandwidth["mib"] == 8 and all(
        bandwidth[k] > 0 for k in ("memcpy_gbps", "store_ingest_gbps", "restore_gbps"))
    # The link the hosts got (unshaped loopback here), measured before the strategies.
    link = report["link"]
    assert link["requested_gbps"] is None and link["describe"] == "unshaped loopback"
    assert link["one_way_gbps"] > 0 and link["exchange_gbps"] > 0 and link["hosts"] == 2
    assert "link: unshaped loopback; measured one way " in proc.stdout
    # No budget: every version taken, and every timed step's version reported
    # on every holder (after the final status round at the latest).
    for name in ("inmem", "pec"):
        assert (result[name]["versions_taken"], result[name]["versions_skipped"]) == (1.0, 0)
        assert result[name]["versions_committed"] == 1.0 and result[name]["max_commit_lag"] >= 1
    assert result["none"].get("versions_committed") is None
    # Each row's steady ratio with its paired interval (DESIGN.md round 5): the
    # pairs are the positions steady in both (none against itself: every one).
    for row in result.values():
        steady = [not p and not c for p, c in zip(row["step_profiled"], row["step_compiled"],
                                                   strict=True)] if "step_profiled" in row \
            else None
        assert row["pairs"] >= 2 and row["steady_ratio_ci"][0] <= row["steady_ratio_ci"][1]
        if steady is not None:
            assert row["pairs"] <= sum(steady)
    assert result["none"]["steady_ratio_ci"] == [1.0, 1.0]
    # Orbax's emergency manager on the expert-parallel mesh (one data-parallel
    # replica): Orbax builds a persistent-only manager, a version every 2nd step.
    emergency = result["orbax_emergency"]
    assert 0 < emergency["versions_taken"] < 1 and emergency["versions_skipped"] > 0
    assert set(emergency["recovery"]) == {"persistent"}
    assert "| orbax_emergency (a version at " in proc.stdout
    # The baselines' own restores, per tier (the disk one from a cold page cache if allowed).
    assert result["blocking"]["recovery"]["local"]["tiers"] == ["local", "local"]
    assert set(result["blocking_disk"]["recovery"]) == {"disk"}
    assert set(result["orbax_async"]["recovery"]) == {"local"}
    assert all(r["seconds"] > 0 for n in ("blocking", "blocking_disk", "orbax_async",
                                          "orbax_emergency")
               for r in result[n]["recovery"].values())
    # Identical work: every strategy replayed the same steps (2 reps x 3
    # steps and the last block's untimed step), and the bench checked their
    # losses agree bit for bit.
    assert all(row["steps_compared"] == 7 for row in result.values())
    # ... and met the same capacity buckets (recorded per step and strategy).
    assert len(report["buckets"]) == 7 and all(
        len({tuple(f) for f in by.values()}) == 1 for by in report["buckets"].values())
    for row in result.values():
        # Every step of a block but its first: 2 reps x (3 - 1) steps, none of
        # them profiled (these strategies do not profile).
        assert row["median_step_s"] > 0 and row["samples"] == row["steps_timed"] == 4
        assert row["steps_profiled"] == 0 and 0 <= row["steps_compiled"] <= 4
        assert {"spread_s", "ratio", "ckpt_bytes_per_step"} <= set(row)
    assert result["none"]["ratio"] == 1.0 and result["none"]["ckpt_bytes_per_step"] == 0
    # The all-to-all probe rides on every step: a sample per timed step that
    # compiled nothing.
    assert all(row["a2a_samples"] == row["steps_timed"] - row["steps_compiled"]
               and row["a2a_median_s"] > 0 for row in result.values())
    assert result["inmem"]["ckpt_bytes_per_step"] > 0
    assert result["blocking"]["ckpt_bytes_per_step"] > 0
    # CPU per timed step by thread group (launch.cluster.cpu_account), both hosts summed:
    # every total is its groups' sum; only inmem and pec have a chunk sender
    # (on CPU with 2 replicas the bench's auto path puts every in-memory row on
    # the threaded chunk channel: one transport per comparison); the store
    # writers' CPU is counted in nanoseconds (schedstat), so even tiny's short
    # writes show (with /proc's 10 ms ticks they read 0 in 2 of 3 CI runs).
    for name, row in result.items():
        cpu = row["cpu_ms_per_step"]
        assert abs(cpu["total"] - sum(v for k, v in cpu.items() if k != "total")) < 0.1
        assert cpu["xla_compute"] + cpu["runtime"] > 0
        assert row["transport"] == ("threaded" if name in ("inmem", "pec") else None)
        if name not in ("inmem", "pec"):
            assert cpu["chunk_sender"] == cpu["chunk_receiver"] == 0.0
    if cpu_account.RESOLUTION_S < 1e-6:
        for name in ("inmem", "pec"):
            assert result[name]["cpu_ms_per_step"]["ckpt_writers"] > 0
            assert result[name]["cpu_ms_per_step"]["chunk_sender"] > 0
    assert "inmem: CPU per timed step, all hosts: " in proc.stdout
    recovery = result["inmem"]["recovery"]
    assert recovery["local"]["bytes_moved"] == 0
    assert recovery["local"]["tiers"] == ["local", "local"]
    assert recovery["peer"]["tiers"] == ["local", "peer"] and recovery["peer"]["bytes_moved"] > 0
    # PEC (K=2 of 8 experts) moves the non-expert state and a quarter of the experts.
    assert 0 < result["pec"]["ckpt_bytes_per_step"] < 0.5 * result["inmem"]["ckpt_bytes_per_step"]
    assert result["pec"]["recovery"]["peer"]["tiers"] == ["local", "peer"]
    assert "| inmem (committed 100%, lag <= " in proc.stdout and "repetition 2/2" in proc.stdout
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert_no_orphans(str(tmp_path / "w"))


def test_bench_failure_reports_no_numbers(tmp_path):
    out = tmp_path / "bench.json"
    # Three replicas on two hosts: the in-memory strategy cannot be built.
    proc = _bench("--strategies=none,inmem", "--replicas=3", "--model=tiny", "--steps=2",
                  "--reps=1", f"--store_root={tmp_path / 'shm'}", f"--workdir={tmp_path / 'w'}",
                  f"--json={out}")
    assert proc.returncode != 0
    assert "no results reported" in proc.stderr
    assert not out.exists() and "| none |" not in proc.stdout
    bad = _bench("--strategies=none,bogus", f"--workdir={tmp_path / 'w2'}", timeout=60)
    assert bad.returncode == 2 and "--strategies" in bad.stderr


@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_bench_long_run_contract_on_an_emulated_run(tmp_path):
    """The long-run accounting (DESIGN.md contracts) on a short emulated run
    behind shaped links: the three numbers per strategy, per timed step the
    windows' byte records and every collective, and none's warm-up treated
    like the others' (its own compile, although the control compiled the same
    program before it). The control (the emulator's floor) moves the
    in-memory tier's bytes of a version (capricorn's) with no checkpoint;
    the same point at ``--time_scale=2`` keeps the bytes and halves the
    measured link (``tests/test_time_scale.py``). inmem runs in the bench
    in ``test_bench_reports_every_strategy``."""
    out = tmp_path / "bench.json"
    point = ("--accelerator=emulated", "--hosts=2", "--devices_per_host=2", "--workload=dynamic",
             "--shift_every=4", "--link_gbps=0.126", "--link_burst_kb=20", "--bandwidth_mib=0",
             f"--store_root={tmp_path / 'shm'}")
    proc = _bench("--strategies=control,none,capricorn", *point, "--link_probe_mib=2",
                  "--steps=6", "--reps=1",
                  "--warmup=3", f"--workdir={tmp_path / 'w'}", f"--json={out}", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "steady ratio | long-run ratio | warm-up (s)" in proc.stdout
    doc = json.loads(out.read_text())
    rows = doc["strategies"]
    assert doc["config"]["collectives"] and doc["config"]["shift_every"] == 4
    for name, row in rows.items():
        assert row["steps_timed"] == 5
        # Each strategy compiled its own step in its warm-up, none after the control too.
        assert row["warmup_compiles"] >= 1, name
        assert row["long_run_ratio"] is not None and row["warmup_s"] is not None
        # The strategy's planning between two steps (re-plans), on the timed path.
        assert row["blocked_ms"]["phase.plan"] >= 0, name
        assert len(row["windows"]) == len(row["collectives"]) == len(row["expert_spans"]) == 5
        assert row["record_steps"] == sorted(row["record_steps"])
        for profiled, collectives in zip(row["step_profiled"], row["collectives"], strict=True):
            if profiled and name != "capricorn":  # an instrumented variant, not the probe
                assert collectives == []
                continue
            # capricorn's profiled steps run its own program (its marks are
            # the profile: issue 38 part 4), the probe on it as on every step.
            names = {c["name"] for c in collectives}
            assert {"block1/fwd/dispatch", "block1/fwd/combine", "block1/bwd/dispatch",
                    "block1/bwd/combine", "grad_all_reduce"} <= names, name
            assert all(c["seconds"] >= 0 for c in collectives)
    assert rows["none"]["steady_ratio"] == rows["none"]["long_run_ratio"] == 1.0
    # R over the spans outside every collective: the same link time over a
    # smaller idle time than R's (which holds the gradient all-reduce).
    idle = idle_outside_collectives(rows["none"])
    assert idle is not None and doc["span_idle_share"] == pytest.approx(
        doc["link_idle_share"] * (rows["none"]["steady_median_s"]
                                  - rows["none"]["a2a_median_s"]) / idle)
    assert "over the spans outside every collective (the all-reduce too): " in proc.stdout
    # Only the scheduled strategy has windows; each accounts for every byte.
    assert not any(rows["none"]["windows"]) and not any(rows["control"]["windows"])
    windows = [w for step in rows["capricorn"]["windows"] for w in step]
    assert windows and all(w["bytes_planned"] > 0 for w in windows)
    # Handed over in a window: its own bytes less those the deadline carried
    # on, plus the earlier windows' it took; each one inside it or late.
    assert all(w["bytes_sent"] + w["bytes_late"]
               == w["bytes_planned"] - w["bytes_carried"] + w["bytes_carried_in"]
               for w in windows)
    assert all(min(w["bytes_sent"], w["bytes_late"], w["bytes_carried"],
                   w["bytes_carried_in"]) >= 0 for w in windows)
    assert all(w["planned_idle_s"] > 0 and w["observed_idle_s"] >= 0 for w in windows)
    # The tables read it.
    tables = subprocess.run([sys.executable, "-m", "launch.tables", "windows", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert tables.returncode == 0 and "### capricorn" in tables.stdout, tables.stderr
    # The control: the in-memory tier's bytes of a version per step (what
    # capricorn moves), each version acknowledged whole by the peer, no
    # recovery row (the bench compared its losses with none's).
    control = rows["control"]
    assert control["ckpt_bytes_per_step"] == rows["capricorn"]["ckpt_bytes_per_step"] > 0
    sent = [v for v in control["schedule"]["versions"] if v["outcome"] == "sent"]
    assert sent and all(v["bytes"] == v["sent"] == v["received"] for v in sent)
    assert "recovery" not in control and control.get("steady_ratio_ci") is not None
    # Time dilation: the same point at k = 2 moves the same bytes over a link
    # measured at half the rate; R moves up by the fixed-time work's share
    # (tests/test_time_scale.py's slow pair says why it is not held to 5%).
    # Its probe moves half the bytes, so that it lasts as long as k = 1's: the
    # probe's fixed-time gaps weigh the same in both, and the ratio holds them out.
    out2 = tmp_path / "bench_k2.json"
    proc = _bench("--strategies=none,control", *point, "--link_probe_mib=1", "--time_scale=2",
                  "--steps=3", "--reps=1",
                  "--warmup=2", f"--workdir={tmp_path / 'w2'}", f"--json={out2}", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = json.loads(out2.read_text())
    assert (doc["time_scale"], two["time_scale"]) == (1.0, 2.0)
    assert (two["strategies"]["control"]["ckpt_bytes_per_step"]
            == control["ckpt_bytes_per_step"])
    assert doc["link"]["one_way_gbps"] / two["link"]["one_way_gbps"] == pytest.approx(2.0, rel=0.05)
    assert 0.95 * doc["link_idle_share"] <= two["link_idle_share"] <= 2.5 * doc["link_idle_share"]


@pytest.mark.soak
def test_bench_scheduled_strategies(tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench("--strategies=none,gemini,capricorn,capricorn_pec", "--model=tiny",
                  "--dispatch=fixed",
                  "--workload=steady", "--steps=8", "--reps=1", "--profile_first_n=3",
                  "--warmup=4", f"--store_root={tmp_path / 'shm'}", f"--workdir={tmp_path / 'w'}",
                  f"--json={out}", timeout=900)  # a hang guard: 4 strategies, 2 hosts
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())["strategies"]
    # Every step of the block but its first is timed, profiled ones included;
    # every step's loss agreed across the strategies (1 rep x (8 + 1) steps).
    assert all(row["steps_timed"] == 7 for row in result.values())
    assert all(row["steps_compared"] == 9 for row in result.values())
    # The first 3 profiles (--profile_first_n) fall in the 4 warm-up steps and
    # the steady load never moves the detector: gemini profiles exactly those
    # and no timed step; capricorn's later profiles (a spill's request) are
    # the only profiled steps that can be timed; none is never profiled.
    assert result["none"]["steps_profiled"] == 0
    assert len(result["gemini"]["schedule"]["profiled_steps"]) == 3
    assert result["gemini"]["steps_profiled"] == 0
    for name in ("capricorn", "capricorn_pec"):
        profiled = result[name]["schedule"]["profiled_steps"]
        assert len(profiled) >= 3 and result[name]["steps_profiled"] <= len(profiled) - 3
    for name in ("gemini", "capricorn"):
        schedule = result[name]["schedule"]
        assert schedule["scheduled"], name
        assert sum(schedule["window_bytes"]) + schedule["tail_bytes"] > 0
        assert result[name]["ckpt_bytes_per_step"] > 0
    # The all-to-all time under the chunks' traffic (every unprofiled step is probed).
    assert result["gemini"]["a2a_samples"] >= 1 and result["gemini"]["a2a_median_s"] > 0
    # capricorn with PEC (K=2 of 8) moves fewer bytes per step, on its own schedule.
    assert result["capricorn_pec"]["schedule"]["scheduled"]
    assert (0 < result["capricorn_pec"]["ckpt_bytes_per_step"]
            < 0.5 * result["capricorn"]["ckpt_bytes_per_step"])
    # Gemini partitions once, from its first profiled steps, and never again.
    assert result["gemini"]["schedule"]["partitions"] == 1
    assert len(result["gemini"]["schedule"]["repartition_steps"]) == 1
    for name in ("gemini", "capricorn"):  # a re-partition follows a profiled step, a
        schedule = result[name]["schedule"]  # cache hit on another capacity tuple, or
        assert set(schedule["repartition_steps"]) <= (  # capricorn's cost model at a load
            set(schedule["profiled_steps"]) | set(schedule["cache_replan_steps"])
            | set(schedule["model_replan_steps"]))
        # Each one says what it was planned on: the model's exactly at its steps.
        pairs = list(zip(schedule["repartition_steps"], schedule["repartition_sources"],
                         strict=True))
        assert {s for s, src in pairs if src == "cost_model"} == set(
            schedule["model_replan_steps"])
    assert not result["gemini"]["schedule"]["cache_replan_steps"]
    assert not result["gemini"]["schedule"]["model_replan_steps"]


@pytest.mark.soak
def test_bench_single_process_path(tmp_path):
    """The one-GPU path runs the bench in this process (here on the CPU backend)."""
    out = tmp_path / "bench.json"
    proc = _bench("--platform=gpu", "--hosts=1", "--replicas=1", "--devices_per_host=1",
                  "--strategies=none,inmem,pec", "--model=tiny", "--dispatch=fixed", "--steps=3",
                  "--reps=2", "--warmup=2", f"--store_root={tmp_path / 'shm'}",
                  f"--workdir={tmp_path / 'w'}", f"--json={out}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())["strategies"]
    assert set(result) == {"none", "inmem", "pec"}
    assert result["inmem"]["recovery"]["local"]["tiers"] == ["local"]
    bad = _bench("--platform=gpu", "--hosts=2", f"--workdir={tmp_path / 'w2'}", timeout=60)
    assert bad.returncode == 2 and "--hosts=1" in bad.stderr
