"""Shaped links (launch.cluster.netns): each simulated host in its own network namespace.

These tests create real namespaces, veths and tc qdiscs, so they need root and
iproute2; elsewhere they are skipped with that reason (and the launcher itself
refuses --link_gbps with a one-line error, tested below as a non-root user).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from launch.cluster import netns
from tests.helpers import ROOT, assert_no_orphans, child_env, run_train

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="shaped links need root and iproute2 (ip, tc)")


def _job_namespaces(pid: int) -> list[str]:
    return netns.job_namespaces(f"{netns.PREFIX}{pid}")


@pytest.mark.parametrize("kwargs,match", [
    ({"gbps": -1.0}, "--link_gbps"),
    ({"gbps": float("nan")}, "--link_gbps"),
    ({"gbps": 1.0, "latency_ms": -2.0}, "--link_latency_ms"),
    ({"gbps": 0.0, "latency_ms": 2.0}, "--link_latency_ms needs --link_gbps"),
    ({"gbps": 1.0, "burst_kb": 1.0}, "--link_burst_kb must be 0 \\(one frame\\) or hold one frame "
     "of 1514 bytes \\(the kernel's MTU 1500 and the Ethernet header\\), got 1.0"),
    ({"gbps": 1.0, "burst_kb": -3.0}, "--link_burst_kb must be"),
    ({"gbps": 1.0, "burst_kb": float("nan")}, "--link_burst_kb must be .*got nan"),
    ({"gbps": 1.0, "burst_kb": float("inf")}, "--link_burst_kb must be .*got inf"),
    ({"gbps": 0.0, "burst_kb": 20.0}, "--link_burst_kb needs --link_gbps"),
    ({"gbps": 1.0, "traffic_class": "wfq"}, "--traffic_class must be one of fifo, priority"),
    ({"gbps": 0.0, "traffic_class": "priority"}, "--traffic_class=priority needs --link_gbps"),
    ({"gbps": 1.0, "latency_ms": 2.0, "traffic_class": "priority"},
     "--traffic_class=priority and --link_latency_ms"),
    ({"gbps": 0.0, "mtu": 9000}, "--link_mtu needs --link_gbps"),
    ({"gbps": 1.0, "mtu": 1000}, "--link_mtu must be 0 .* or in 1280..65000, got 1000"),
    ({"gbps": 1.0, "mtu": 70000}, "--link_mtu must be .*got 70000"),
    ({"gbps": 0.0, "filler": True}, "--link_filler needs --link_gbps > 0"),
    ({"gbps": 1.0, "latency_ms": 2.0, "filler": True}, "--link_filler and --link_latency_ms"),
    ({"gbps": 1.0, "burst_kb": 5, "mtu": 9000},
     "--link_burst_kb must be .* one frame of 9014 bytes \\(--link_mtu=9000 and .*got 5"),
])
def test_bad_link_options_name_the_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        netns.LinkOptions(**kwargs)


def test_unshaped_is_the_default():
    assert not netns.LinkOptions().shaped
    assert netns.LinkOptions().describe() == "unshaped loopback"
    assert netns.LinkOptions(gbps=0.5).describe() == "0.5 Gbit/s each way per host"


def test_the_bucket_is_the_flag_or_the_default():
    # Default: one frame at the link's MTU, whatever the rate (tests/test_link_shaping.py).
    assert netns.LinkOptions(gbps=0.154).burst_bytes() == 1514
    assert netns.LinkOptions(gbps=8.0, mtu=9000).burst_bytes() == 9014
    assert netns.LinkOptions(gbps=0.1, burst_kb=1.514).burst_bytes() == 1514  # the smallest
    small = netns.LinkOptions(gbps=0.154, burst_kb=20)
    assert small.burst_bytes() == 20_000
    assert small.describe() == "0.154 Gbit/s each way per host, a 20 KB bucket"
    assert small.record()["burst_bytes"] == 20_000
    assert netns.LinkOptions().record()["burst_bytes"] is None


def test_the_frame_size_is_recorded_and_described():
    jumbo = netns.LinkOptions(gbps=0.1, burst_kb=20, mtu=9000)
    assert jumbo.record()["mtu"] == 9000
    assert jumbo.describe() == "0.1 Gbit/s each way per host, a 20 KB bucket, 9000-byte frames"
    assert netns.LinkOptions(gbps=0.1).record()["mtu"] == 1500
    assert netns.LinkOptions().record()["mtu"] is None


def test_the_traffic_class_is_recorded_and_described():
    fifo, priority = (netns.LinkOptions(gbps=0.5, traffic_class=c) for c in ("fifo", "priority"))
    assert fifo.record()["traffic_class"] == "fifo" and fifo.describe() == \
        "0.5 Gbit/s each way per host"
    assert priority.record()["traffic_class"] == "priority"
    assert priority.describe().endswith(", checkpoint bytes in a low-priority class")
    from launch.tiers import memory_options

    def options(traffic_class):
        return memory_options(store_root="/nonexistent", job="j", replicas=2, chunk_bytes=1 << 20,
                              replication_timeout_s=30.0, budget_s=-1, pec=None,
                              traffic_class=traffic_class)

    fifo_opts, priority_opts = options("fifo"), options("priority")
    assert (fifo_opts.chunk_tos, fifo_opts.chunk_send) == (0, "windows")
    assert (priority_opts.chunk_tos, priority_opts.chunk_send) == (0x08, "at_once")
    assert fifo_opts.max_wait_s is None


@needs_root
def test_priority_links_put_a_priority_queue_under_each_tbf():
    """Both ends of every link: two bands under the tbf, the second for the
    frames whose TOS byte is the checkpoint's (tests/test_link_shaping.py
    measures what that does)."""
    with netns.ShapedNetwork(2, netns.LinkOptions(gbps=0.25, burst_kb=20,
                                                  traffic_class="priority")) as net:
        for h in range(2):
            for ns, dev in net.shapers(h):
                def show(what, *args, ns=ns, dev=dev):
                    return subprocess.run(["tc", "-n", ns, what, "show", "dev", dev, *args],
                                          capture_output=True, text=True, check=True).stdout
                qdiscs = show("qdisc")
                assert "tbf 1: root" in qdiscs and "htb 10: parent 1:1" in qdiscs, qdiscs
                assert "pfifo 11: parent 10:1" in qdiscs and "pfifo 12: parent 10:2" in qdiscs, \
                    qdiscs
                classes = show("class")
                assert "htb 10:1 root leaf 11: prio 0" in classes, classes
                assert "htb 10:2 root leaf 12: prio 1" in classes, classes
                filters = show("filter", "parent", "10:")
                assert "flowid 10:2" in filters and "match 00080000/00fc0000 at 0" in filters, \
                    filters


@needs_root
def test_jumbo_frames_are_set_on_both_ends_and_pass_the_bucket():
    """--link_mtu=9000: every veth end and the bridge take the frame size, and
    a TCP stream between two hosts arrives whole through tbf's 20 KB bucket
    (a frame larger than the bucket would never leave it)."""
    with netns.ShapedNetwork(2, netns.LinkOptions(gbps=0.5, burst_kb=20, mtu=9000)) as net:
        for ns, dev in ((net.host_namespace(0), "eth0"), (net.host_namespace(1), "eth0"),
                        (net.switch, "h0"), (net.switch, "h1"), (net.switch, "br0")):
            shown = subprocess.run(["ip", "-n", ns, "link", "show", dev],
                                   capture_output=True, text=True, check=True).stdout
            assert " mtu 9000 " in shown, (ns, dev, shown)
        size = 4 << 20
        server = subprocess.Popen(
            [*net.command_prefix(1), sys.executable, "-c",
             "import socket, sys; s = socket.create_server((sys.argv[1], 9301)); "
             "print('ready', flush=True); c, _ = s.accept(); n = 0\n"
             "while (b := c.recv(1 << 16)): n += len(b)\n"
             "print(n, c.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG))",
             net.address(1)], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            subprocess.run(
                [*net.command_prefix(0), sys.executable, "-c",
                 "import socket, sys; c = socket.create_connection((sys.argv[1], 9301), 30); "
                 f"c.sendall(bytes({size})); c.close()", net.address(1)],
                check=True, timeout=60)
            received, mss = (int(x) for x in server.communicate(timeout=60)[0].split())
        finally:
            server.kill()
        assert received == size
        assert mss > 8000, mss  # the connection's segments are jumbo frames


def test_not_root_gives_one_line_error(tmp_path):
    """launch.train run by a user who is not root (its euid made non-zero in
    the child: this machine's interpreter is not reachable for another user)."""
    code = ("import os, runpy, sys; os.geteuid = lambda: 1000; sys.argv = sys.argv[1:]; "
            "runpy.run_module('launch.train', run_name='__main__')")
    proc = subprocess.run(
        [sys.executable, "-c", code, "train", "--link_gbps=1", f"--workdir={tmp_path}/w",
         f"--store_root={tmp_path}/s"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "needs root" in err[0] and "--link_gbps" in err[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "w" / "metrics.jsonl").exists()


@needs_root
def test_latency_needs_netem_or_is_applied(tmp_path):
    """--link_latency_ms uses netem: where the kernel lacks it, one line says
    so before anything starts; where it has it, the links get the delay."""
    ns = f"{netns.PREFIX}{os.getpid()}t"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        has_netem = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root",
                                    "netem", "delay", "1ms"], capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=True)
    if has_netem:
        with netns.ShapedNetwork(2, netns.LinkOptions(gbps=1.0, latency_ms=4.0)) as net:
            shown = subprocess.run(["tc", "-n", net.host_namespace(0), "qdisc", "show"],
                                   capture_output=True, text=True, check=True).stdout
            assert "netem" in shown and "delay 2ms" in shown, shown
        return
    proc = run_train("--link_gbps=1", "--link_latency_ms=4", f"--workdir={tmp_path}/w",
                     f"--store_root={tmp_path}/s", timeout=120)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "netem" in err[0], proc.stderr
    assert not list((tmp_path / "w").glob("metrics.jsonl"))


@needs_root
def test_network_layout_and_removal():
    with netns.ShapedNetwork(3, netns.LinkOptions(gbps=0.25, burst_kb=20)) as net:
        names = set(_job_namespaces(os.getpid()))
        assert names == {net.switch, *(net.host_namespace(h) for h in range(3))}
        for h in range(3):
            ns = net.host_namespace(h)
            qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "eth0"],
                                   capture_output=True, text=True, check=True).stdout
            assert "tbf" in qdisc and "250Mbit" in qdisc and "burst 20000b" in qdisc, qdisc
            down = subprocess.run(["tc", "-n", net.switch, "qdisc", "show", "dev", f"h{h}"],
                                  capture_output=True, text=True, check=True).stdout
            assert "tbf" in down and "250Mbit" in down and "burst 20000b" in down, down
            hosts = (netns.NETNS_ETC / ns / "hosts").read_text()
            assert f"{net.address(h)} " in hosts
            # The host reaches every other host over the bridge, and nothing else.
            for other in range(3):
                ping = subprocess.run(["ip", "netns", "exec", ns, "python3", "-c",
                                       "import socket,sys; s=socket.socket(); s.settimeout(3); "
                                       "r=s.connect_ex((sys.argv[1], 9)); print(r)",
                                       net.address(other)],
                                      capture_output=True, text=True, timeout=30)
                # Refused (nothing listens on port 9) means the host answered.
                assert ping.stdout.strip() == "111", (h, other, ping.stdout, ping.stderr)
            route = subprocess.run(["ip", "-n", ns, "route", "show", "default"],
                                   capture_output=True, text=True, check=True).stdout
            assert route.strip() == ""
    assert _job_namespaces(os.getpid()) == []
    assert not list(netns.NETNS_ETC.glob(f"{net.job}[sh]*"))


@needs_root
def test_stale_namespaces_of_a_dead_job_are_removed():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    job = f"{netns.PREFIX}{dead.pid}"
    for suffix in ("s", "h0"):
        subprocess.run(["ip", "netns", "add", job + suffix], check=True)
    (netns.NETNS_ETC / f"{job}h0").mkdir(parents=True, exist_ok=True)
    live = f"{netns.PREFIX}{os.getpid()}h7"  # a live job's namespace is left alone
    subprocess.run(["ip", "netns", "add", live], check=True)
    try:
        gone = netns.remove_stale()
        assert {f"{job}s", f"{job}h0"} <= set(gone)
        assert live not in gone
        assert _job_namespaces(dead.pid) == []
        assert not (netns.NETNS_ETC / f"{job}h0").exists()
        assert live in netns.namespaces(live)
    finally:
        subprocess.run(["ip", "netns", "del", live], capture_output=True)


@needs_root
@pytest.mark.slow
@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_two_hosts_on_shaped_links_train_and_recover(tmp_path):
    workdir = tmp_path / "run"
    # With the traffic class: the chunk channel's bytes in the low-priority
    # band of each link's priority queue (FIFO links: the bench tests), and
    # capricorn's versions moved in their steps without waiting for windows.
    proc = run_train("--hosts=2", "--devices_per_host=2", "--steps=8", "--log_every=4",
                     "--ckpt=capricorn", "--kill_host=1", "--kill_at_step=5",
                     "--link_gbps=0.5",
                     "--traffic_class=priority",
                     "--eval_sequences=0", f"--workdir={workdir}",
                     f"--store_root={tmp_path}/store", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "links: 2 hosts, each in its own network namespace behind 0.5 Gbit/s" in proc.stdout
    assert "checkpoint bytes in a low-priority class" in proc.stdout
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    recoveries = [r for r in records if r.get("event") == "recovery"]
    assert len(recoveries) == 1 and recoveries[0]["tier"] in ("local", "peer"), recoveries
    steps = sorted({r["step"] for r in records if "event" not in r})
    assert steps == list(range(8))
    moved = [r for r in records if r.get("event") == "checkpoint" and "moved_in_step" in r]
    assert moved and not any(r.get("windows") for r in moved), moved
    assert netns.stale_namespaces() == []
    assert_no_orphans(str(workdir))


@needs_root
@pytest.mark.slow
@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_no_namespace_left_after_the_supervisor_is_killed(tmp_path):
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.train", "--hosts=2", "--devices_per_host=1",
         "--steps=500", "--ckpt=none", "--link_gbps=0.5", "--eval_sequences=0",
         f"--workdir={workdir}", f"--store_root={tmp_path}/store"],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (workdir / "metrics.jsonl").exists():  # hosts joined, training
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.5)
        assert len(_job_namespaces(proc.pid)) == 3
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 60
        while _job_namespaces(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _job_namespaces(proc.pid) == []
        assert not list(netns.NETNS_ETC.glob(f"{netns.PREFIX}{proc.pid}[sh]*"))
        assert_no_orphans(str(workdir), grace_s=30)
    finally:
        if proc.poll() is None:
            proc.kill()


@needs_root
@pytest.mark.slow
@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_measured_link_rate_is_within_a_factor_of_the_requested_one(tmp_path):
    """launch.link_probe on shaped links and on loopback: the shaped rate is
    near the flag, and far below what the same probe gets on loopback."""
    out = {}
    for gbps in (0.3, 0.0):
        path = tmp_path / f"link{gbps}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "launch.link_probe", "--hosts=2", "--devices_per_host=2",
             "--mib=4", f"--link_gbps={gbps}", f"--json={path}", f"--workdir={tmp_path}/w{gbps}"],
            cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "Gloo" not in proc.stdout
        out[gbps] = json.loads(path.read_text())
    shaped, loopback = out[0.3], out[0.0]
    assert shaped["requested_gbps"] == 0.3 and loopback["requested_gbps"] is None
    assert 0.3 / 3 <= shaped["one_way_gbps"] <= 0.3 * 1.5, shaped
    assert 0.3 / 6 <= shaped["exchange_gbps"] <= 0.3 * 1.5, shaped
    assert loopback["one_way_gbps"] > 2 * shaped["one_way_gbps"], (loopback, shaped)
    assert netns.stale_namespaces() == []


@needs_root
@pytest.mark.soak
def test_bench_on_shaped_links_records_the_link(tmp_path):
    path = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "launch.bench", "--strategies=none,inmem", "--steps=2",
         "--reps=1", "--warmup=1", "--a2a_steps=1", "--bandwidth_mib=0", "--link_probe_mib=4",
         "--link_gbps=0.3", f"--json={path}", f"--store_root={tmp_path}/s",
         f"--workdir={tmp_path}/w"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(path.read_text())
    assert result["link"]["requested_gbps"] == 0.3
    assert 0.3 / 3 <= result["link"]["one_way_gbps"] <= 0.3 * 1.5, result["link"]
    assert "link: 0.3 Gbit/s each way per host; measured one way" in proc.stdout
    assert netns.stale_namespaces() == []
