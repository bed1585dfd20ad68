"""launch.cluster.cpu_account: CPU time by thread group, and the bench's per-step sums."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from launch.bench.report import cpu_per_step
from launch.cluster import cpu_account

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _spin(cpu_s: float) -> None:
    """Burns ``cpu_s`` seconds of this thread's CPU (not wall time)."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_a_named_thread_s_cpu_lands_in_its_group_and_nowhere_else() -> None:
    before = cpu_account.sample()
    done = threading.Event()
    during: dict = {}

    def writer() -> None:
        _spin(0.5)
        now = cpu_account.sample()  # sampled while this thread is alive
        assert now is not None
        during.update(now)
        done.set()

    t = threading.Thread(target=writer, name="ckpt-own-writer")
    t.start()
    done.wait(60)
    t.join(60)
    # The OS thread outlives join() by a moment; once it is gone from /proc its
    # time is the process's only.
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/self/task/{t.native_id}") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(f"/proc/self/task/{t.native_id}")
    used = dict(zip(cpu_account.GROUPS, cpu_account.delta(before, during), strict=True))
    assert used["ckpt_writers"] >= 0.45  # a few 10 ms ticks of quantization
    assert used["chunk_sender"] == used["chunk_receiver"] == 0.0
    # Once the thread has ended, its time moves to "exited", not lost.
    after = dict(zip(cpu_account.GROUPS, cpu_account.delta(before, cpu_account.sample()),
                     strict=True))
    assert after["ckpt_writers"] == 0.0
    assert after["exited"] >= 0.45


def test_the_training_thread_is_main() -> None:
    before = cpu_account.sample()
    _spin(0.2)
    used = dict(zip(cpu_account.GROUPS, cpu_account.delta(before, cpu_account.sample()),
                    strict=True))
    assert used["main"] >= 0.18


def test_delta_without_samples_is_zeros() -> None:
    assert cpu_account.delta(None, cpu_account.sample()) == [0.0] * len(cpu_account.GROUPS)


def test_cpu_per_step_sums_hosts_and_divides_by_steps() -> None:
    n = len(cpu_account.GROUPS)
    host0 = [0.0] * n
    host1 = [0.0] * n
    host0[cpu_account.GROUPS.index("main")] = 1.0
    host1[cpu_account.GROUPS.index("main")] = 0.5
    host1[cpu_account.GROUPS.index("ckpt_writers")] = 0.25
    out = cpu_per_step([host0, host1], 10)
    assert out["main"] == 150.0
    assert out["ckpt_writers"] == 25.0
    assert out["total"] == 175.0


@pytest.mark.skipif(cpu_account.RESOLUTION_S > 1e-6, reason="kernel without schedstat")
def test_cpu_below_one_clock_tick_is_counted() -> None:
    """3 ms of a writer's CPU, under the 10 ms a /proc tick resolves, is seen."""
    result: dict = {}

    def writer() -> None:
        before = cpu_account.sample()
        _spin(0.003)
        result.update(zip(cpu_account.GROUPS, cpu_account.delta(before, cpu_account.sample()),
                          strict=True))

    t = threading.Thread(target=writer, name="ckpt-short-writer")
    t.start()
    t.join(60)
    assert result["ckpt_writers"] >= 0.003
