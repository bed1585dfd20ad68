"""The planner's own thread (``strategies.plan_thread``): jobs run in order on
it, a job's error reaches the training thread naming the step that submitted
it, and a job that never finishes is waited for within its bound, not forever."""

from __future__ import annotations

import threading

import pytest

from capricorn_jax._src.strategies import plan_thread
from capricorn_jax._src.strategies.plan_thread import PlanThread, plan_stream


def test_jobs_run_in_submission_order_on_the_named_thread():
    thread, seen = PlanThread("capricorn-plan"), []
    jobs = [thread.submit(step, lambda step=step: seen.append(step) or step * 10)
            for step in (3, 1, 2)]
    assert [job.outcome() for job in jobs] == [30, 10, 20]
    assert seen == [3, 1, 2] and thread.ran == 3 and thread.thread_names == {"capricorn-plan"}
    worker = thread._thread
    thread.close()
    assert worker is not None and not worker.is_alive()


def test_a_failed_job_raises_on_the_training_thread_naming_its_step():
    thread = PlanThread()

    def fails():
        raise ConnectionError("host 1 left the agreement")

    job = thread.submit(7, fails)
    with pytest.raises(RuntimeError, match="the re-plan submitted at step 7 failed") as info:
        job.outcome()
    assert isinstance(info.value.__cause__, ConnectionError)
    assert thread.submit(8, lambda: "next").outcome() == "next"  # the thread goes on
    thread.close()


def test_a_job_that_never_finishes_is_waited_for_within_its_bound(monkeypatch):
    monkeypatch.setattr(plan_thread, "current_timeout", lambda: 0.1)
    monkeypatch.setattr(plan_thread, "JOIN_MARGIN_S", 0.2)
    thread, release = PlanThread(), threading.Event()
    job = thread.submit(4, release.wait)
    with pytest.raises(TimeoutError, match=r"submitted at step 4 did not finish within 0.3s"):
        job.outcome()
    release.set()
    assert job.done.wait(5) and job.outcome() is True
    thread.close()


def test_each_stream_is_new_and_numbered_in_call_order():
    first, second = plan_stream(), plan_stream()
    assert first.startswith("plan") and second == f"plan{int(first[4:]) + 1}"
