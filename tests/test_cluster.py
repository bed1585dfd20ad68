"""launch.cluster.processes: the simulated cluster's processes (CPU pinning)."""

import os
import sys

import pytest

from launch.cluster import processes as cluster_lib


def test_cpu_sets_split_this_process_cpus_round_robin():
    cpus = sorted(os.sched_getaffinity(0))
    sets = cluster_lib.cpu_sets_per_host(len(cpus))
    assert sets == [frozenset({c}) for c in cpus]  # one CPU each, disjoint
    one = cluster_lib.cpu_sets_per_host(1)
    assert one == [frozenset(cpus)]
    more = cluster_lib.cpu_sets_per_host(len(cpus) + 1)  # more hosts than CPUs
    assert all(len(s) == 1 for s in more) and set().union(*more) == set(cpus)
    with pytest.raises(ValueError, match="hosts"):
        cluster_lib.cpu_sets_per_host(0)


@pytest.mark.slow
def test_pinned_hosts_run_on_their_cpu_sets():
    cpus = sorted(os.sched_getaffinity(0))
    sets = cluster_lib.cpu_sets_per_host(2)
    lines: dict[int, list[str]] = {0: [], 1: []}
    cluster = cluster_lib.LocalCluster(
        lambda h: ["-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        hosts=2, devices_per_host=1, on_line=lambda h, line: lines[h].append(line.strip()),
        cpu_sets=sets)
    assert cluster_lib.run(cluster, timeout_s=60) == 0
    for host in (0, 1):
        assert lines[host] == [str(sorted(sets[host]))]
    # Without cpu_sets a host keeps the supervisor's CPUs.
    lines = {0: []}
    cluster = cluster_lib.LocalCluster(
        lambda h: ["-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        hosts=1, devices_per_host=1, on_line=lambda h, line: lines[h].append(line.strip()))
    assert cluster_lib.run(cluster, timeout_s=60) == 0
    assert lines[0] == [str(cpus)]
    with pytest.raises(ValueError, match="cpu_sets"):
        cluster_lib.LocalCluster(lambda h: [sys.executable], 1, 1, cpu_sets=[set()])


@pytest.mark.slow
def test_run_stops_on_sigint_even_when_started_with_sigint_ignored(tmp_path):
    """A job started in the background by a non-interactive shell inherits
    SIGINT ignored; run() installs its own handler, so SIGINT still stops it."""
    import signal
    import subprocess
    import time

    from tests.helpers import ROOT, processes_mentioning

    marker = f"sleeping-host-{tmp_path.name}"
    script = (
        "import sys\n"
        "from launch.cluster import processes as c\n"
        # The marker is assembled here so that only the host's command line holds it.
        f"marker = 'sleeping-' + '{marker[len('sleeping-'):]}'\n"
        "cl = c.LocalCluster(lambda h: ['-c', 'import time; time.sleep(120)', marker], 1, 1)\n"
        "print('code', c.run(cl, timeout_s=120), flush=True)\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 60
    while not processes_mentioning(marker):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert out.strip().splitlines()[-1] == "code 130"
    assert processes_mentioning(marker) == []


def test_a_host_that_outlives_its_signal_is_named_within_the_bound(monkeypatch):
    """kill_host waits KILL_WAIT_S at most (a process stuck in the kernel would
    outlive even SIGKILL; here one that ignores SIGUSR1 stands in for it)."""
    import signal
    import threading

    monkeypatch.setattr(cluster_lib, "KILL_WAIT_S", 0.5)
    ready = threading.Event()
    cluster = cluster_lib.LocalCluster(
        lambda h: ["-c", "import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
                         "print('ready', flush=True); time.sleep(60)"],
        hosts=1, devices_per_host=1, on_line=lambda h, line: ready.set())
    cluster.start()
    try:
        assert ready.wait(60)  # the child ignores SIGUSR1 from here on
        with pytest.raises(RuntimeError, match=r"host 0 \(pid \d+\) did not exit within 0.5s "
                                               r"of signal 10"):
            cluster.kill_host(0, signal.SIGUSR1)
    finally:
        cluster.stop(grace_s=1.0)
