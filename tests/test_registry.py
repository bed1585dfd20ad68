"""The strategy registry: one spec per strategy, read by every name list.

The unit tests check the registry's rules; the slow one adds a toy strategy
through the registry alone (``tests/toy_strategy.py``, named in the
environment as a user would) and runs it through launch.bench and a chaos
trial: nothing else in the repository names it.
"""

import json
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capricorn_jax.experimental import BuildArgs, StrategySpec, register, spec, specs, unregister
from launch import strategies
from tests.helpers import ROOT, child_env

PATHS = ("auto", "in_graph", "threaded")


def test_the_library_and_the_launchers_register_every_strategy_once():
    names = [s.name for s in specs()]
    assert len(names) == len(set(names))
    assert set(strategies.STRATEGIES) == set(names)
    assert strategies.STRATEGIES[:4] == ("none", "blocking", "orbax_async", "orbax_emergency")
    assert strategies.SCHEDULED == ("gemini", "capricorn", "capricorn_pec")
    assert strategies.PEC == ("pec", "capricorn_pec")
    assert strategies.STRATEGY_PROFILE == {"gemini": "first_n", "capricorn": "speculative",
                                           "capricorn_pec": "speculative"}


def test_a_second_spec_under_a_name_and_an_unknown_name_are_errors():
    with pytest.raises(ValueError, match="strategy 'inmem' is already registered"):
        register(StrategySpec("inmem", lambda a: None, in_memory=True))
    with pytest.raises(ValueError, match=r"unknown strategy 'nope'; known: .*capricorn"):
        spec("nope")
    with pytest.raises(KeyError, match="no strategy 'nope'"):
        unregister("nope")
    with pytest.raises(ValueError, match="PEC and a planner need the in-memory tier"):
        StrategySpec("bad", lambda a: None, pec=True)
    with pytest.raises(ValueError, match="planner must be one of"):
        StrategySpec("bad", lambda a: None, in_memory=True, planner="greedy")


def test_a_registered_toy_is_found_built_and_removed():
    built = []
    toy = StrategySpec("toy_unit", lambda a: built.append(a) or "built",
                       in_memory=True, pec=True)
    register(toy)
    try:
        assert spec("toy_unit") is toy and toy in specs() and toy.label == "toy_unit"
        with pytest.raises(ValueError, match="'toy_unit' needs in-memory checkpointer"):
            strategies.build("toy_unit", BuildArgs(train=None))
    finally:
        unregister("toy_unit")
    assert "toy_unit" not in [s.name for s in specs()]


@given(st.sampled_from([s.name for s in specs()]), st.sampled_from(PATHS),
       st.sampled_from(("cpu", "gpu")))
def test_the_channel_answer_follows_the_resolved_path(name, path, backend):
    """One answer to "does it use the chunk channel?": only an in-memory
    strategy, only where its path resolves to threaded; auto is threaded for
    the scheduled ones off GPU, the in-graph exchange for the others."""
    s = spec(name)
    resolved = s.resolved_path(path, backend)
    assert resolved == (path if path != "auto" else
                        "threaded" if s.scheduled and backend != "gpu" else "in_graph")
    assert s.uses_channel(path, backend) == (s.in_memory and resolved == "threaded")
    assert strategies.uses_channel(name, path, backend) == s.uses_channel(path, backend)


def test_the_channel_answer_on_gpu_is_in_graph_for_auto():
    """launch.train used to answer "on the channel" for every scheduled
    strategy, wrong on GPU where auto means in-graph."""
    assert not spec("capricorn").uses_channel("auto", "gpu")
    assert spec("capricorn").uses_channel("auto", "cpu")
    assert not spec("inmem").uses_channel("auto", "cpu")
    assert spec("pec").uses_channel("threaded", "gpu")
    assert not spec("orbax_async").uses_channel("threaded", "cpu")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_toy_strategy_added_through_the_registry_runs_in_the_bench_and_a_chaos_trial(
        tmp_path):
    env = {**child_env(), strategies.PLUGINS_ENV: "tests.toy_strategy"}
    out = tmp_path / "bench.json"
    bench = subprocess.run(
        [sys.executable, "-m", "launch.bench", "--strategies=none,toy", "--hosts=1",
         "--devices_per_host=2", "--replicas=1", "--model=tiny", "--dispatch=fixed",
         "--steps=2", "--reps=1", "--warmup=1", "--bandwidth_mib=0",
         f"--store_root={tmp_path / 'stores'}", f"--workdir={tmp_path / 'bw'}",
         f"--json={out}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    rows = json.loads(out.read_text())["strategies"]
    assert set(rows) == {"none", "toy"} and rows["toy"]["ckpt_bytes_per_step"] > 0
    chaos_json = tmp_path / "chaos.json"
    chaos = subprocess.run(
        [sys.executable, "-m", "launch.chaos", "--trials=1", "--seed=3", "--strategies=toy",
         "--topologies=2x1", "--steps=8", f"--workdir={tmp_path / 'cw'}",
         f"--json={chaos_json}"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=1200)
    assert chaos.returncode == 0, chaos.stdout[-4000:] + chaos.stderr[-3000:]
    report = json.loads(chaos_json.read_text())
    assert (report["passed"], report["failed"]) == (1, 0)
    assert report["trials"][0]["strategy"] == "toy"
