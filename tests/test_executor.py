"""The in-step executor: chunks sent at layer boundaries, state untouched.

Four CPU devices as two simulated hosts (devices 0,1 and 2,3); the schedule
puts chunks in every kind of window.
"""

import re

import jax
import numpy as np
import pytest

from capricorn_jax._src.memory.wire.packing import encode_trailer
from capricorn_jax._src.scheduling.in_graph.executor import InStepSender, scheduled_step
from capricorn_jax._src.scheduling.plan.partitioner import LinkModel, Window, partition
from capricorn_jax._src.scheduling.plan.sites import AFTER, START, site_of
from tests.helpers import two_host_transport
from tests.tree_utils import assert_trees_equal

BOUNDARIES = ["block0", "block1"]
WINDOWS = [Window("block0", "fwd", 1e-3), Window("block1", "fwd", 1e-3),
           Window("head", "fwd", 1e-3), Window("block1", "bwd", 1e-3),
           Window("tail", "bwd", 1e-3)]


def test_windows_open_at_the_right_boundary():
    assert [site_of(w, BOUNDARIES) for w in WINDOWS] == [
        START, ("block0", "fwd"), ("block1", "fwd"), ("block1", "bwd"), ("block0", "bwd")]


@pytest.fixture(scope="module")
def setup():
    trainer, plan, transport = two_host_transport()
    # 200 kB per window at 100 kB chunks; the rest (about 124 kB) is the tail.
    schedule = partition(plan.payload_bytes, WINDOWS, LinkModel(0.0, 2e8), chunk_cap=100_000)
    assert schedule.tail_bytes > 0 and all(schedule.bytes_in_window(i) for i in range(5))
    sender = InStepSender(transport, trainer.state_shardings, schedule, BOUNDARIES)
    step = scheduled_step(trainer, sender, (2.0, 2.0))
    batch = trainer.global_batch(
        np.random.default_rng(0).integers(0, 256, (16, 65)).astype(np.int32))
    trailer = encode_trailer({"data": 7})
    rows = jax.make_array_from_process_local_data(
        transport.rows, np.broadcast_to(trailer, (4, trailer.size)).copy())
    return trainer, transport, sender, step, batch, trailer, rows


@pytest.mark.slow  # long: compiles or many examples
def test_scheduled_step_trains_bitwise_and_delivers_the_peer_payload(setup):
    trainer, transport, _, step, batch, trailer, rows = setup
    want_state, want_metrics = trainer.step_fn((2.0, 2.0))(trainer.init_state(0), batch)
    own, received, _, _ = transport.replicate(trainer.init_state(0), trailer, np.zeros(3))
    state, metrics, out = step(trainer.init_state(0), batch, rows)
    assert_trees_equal(state, want_state)
    assert float(metrics["loss"]) == float(want_metrics["loss"])
    np.testing.assert_array_equal(np.asarray(out["own"]), np.asarray(own))
    np.testing.assert_array_equal(np.asarray(out["received"]), np.asarray(received[0]))


def _collective_sequence(hlo: str) -> list[str]:
    """Collectives of the scheduled entry computation, in order, as tokens:
    S/F/B = permute outside the model / in its forward / in its backward;
    f0/f1/b1/b0 = the all-to-alls of block i forward/backward."""
    entry = hlo[hlo.index("ENTRY"):]
    out = []
    for line in entry.split("\n"):
        op_name = re.search(r'op_name="([^"]*)"', line)
        if not op_name or not re.search(r" (collective-permute|all-to-all)\(", line):
            continue
        name = op_name.group(1)
        if "ppermute" in name:
            out.append("B" if "transpose(" in name else "F" if "jvp(" in name else "S")
        else:
            block_m = re.search(r"block(\d)", name)
            assert block_m is not None
            block = block_m.group(1)
            out.append(("b" if "transpose(" in name else "f") + block)
    return out


def test_each_chunk_is_sent_at_its_boundary(setup):
    trainer, _, sender, step, batch, _, rows = setup
    hlo = step.lower(trainer.init_state(0), batch, rows).compile().as_text()
    assert "is_scheduled=true" in hlo[:2000]
    seq = _collective_sequence(hlo)
    n = {site: len(chunks) for site, chunks in sender.sites.items()}
    assert seq.count("S") == n[START] + n[AFTER] + 1  # and the payload's CRC32C, last
    assert seq.count("F") == n[("block0", "fwd")] + n[("block1", "fwd")]
    assert seq.count("B") == n[("block1", "bwd")] + n[("block0", "bwd")]
    # Window (block0, fwd) opens at the start of the step.
    assert seq[: n[START]] == ["S"] * n[START]
    # Forward chunks wait for their layer: none before block 0's all-to-all; those of
    # window (block1, fwd) go before block 1's all-to-all, those of (head, fwd) after it.
    first_f0, first_f1 = seq.index("f0"), seq.index("f1")
    forward = [i for i, t in enumerate(seq) if t == "F"]
    assert min(forward) > first_f0
    assert sum(i < first_f1 for i in forward) == n[("block0", "fwd")]
    # Backward chunks wait for the cotangent at block 1's output: after the last forward
    # all-to-all; the tail after every backward chunk.
    last_forward_a2a = max(i for i, t in enumerate(seq) if t in ("f0", "f1"))
    backward = [i for i, t in enumerate(seq) if t == "B"]
    assert min(backward) > last_forward_a2a
    tail = [i for i, t in enumerate(seq) if t == "S"][n[START]:]
    assert min(tail) > max(backward)


def test_schedule_of_another_payload_is_refused(setup):
    trainer, transport, *_ = setup
    schedule = partition(1000, WINDOWS, LinkModel(0.0, 2e8), chunk_cap=100)
    with pytest.raises(ValueError, match="payload"):
        InStepSender(transport, trainer.state_shardings, schedule, BOUNDARIES)



def test_status_gather_alone(setup):
    _, transport, *_ = setup
    got = np.asarray(transport.gather_status(np.array([4, 5, 6])))
    np.testing.assert_array_equal(got, [[4, 5, 6]] * 4)


@pytest.mark.soak
@pytest.mark.slow  # long: compiles or many examples
def test_probed_scheduled_step_times_every_all_to_all_and_changes_nothing(setup):
    """The interference probe inside the scheduled step: the chunks still arrive,
    the state is bitwise the plain step's, and every MoE all-to-all (dispatch
    and combine, forward and backward) of every MoE layer is timed."""
    from capricorn_jax.experimental import CollectiveProbe

    trainer, transport, sender, _, batch, trailer, rows = setup
    probe = CollectiveProbe()
    probed = scheduled_step(trainer, sender, (2.0, 2.0), hooks=(probe,))
    want_state, _ = trainer.step_fn((2.0, 2.0))(trainer.init_state(0), batch)
    own, received, _, _ = transport.replicate(trainer.init_state(0), trailer, np.zeros(3))
    state, _, out = probed(trainer.init_state(0), batch, rows)
    jax.block_until_ready(state)
    assert_trees_equal(state, want_state)
    np.testing.assert_array_equal(np.asarray(out["received"]), np.asarray(received[0]))
    phases = probe.phase_seconds()
    moe = [f"block{i}" for i in trainer.cfg.moe_layers]
    assert set(phases) == {(b, d, c) for b in moe for d in ("fwd", "bwd")
                           for c in ("dispatch", "combine")}
    assert all(s > 0 for s in phases.values())
    assert probe.phase_seconds() == {}  # drained
