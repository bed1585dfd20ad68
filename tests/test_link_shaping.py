"""The shaped links' bucket and traffic class (launch.cluster.netns).

The first tests are pure: the default bucket is one frame, and the tc commands
for ``--traffic_class=priority`` sort by the TOS byte on both of a host's
shapers. The last builds real links (root and iproute2; elsewhere skipped with
that reason) and measures what the class is for: a small message of the
default class crosses a link whose both shapers hold a backlog of checkpoint
bytes (TOS 0x08) within a few frames' time.
"""

import os
import shutil
import statistics
import subprocess
import sys
import time

import pytest

from launch.cluster import netns

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="shaped links need root and iproute2 (ip, tc)")


@pytest.mark.parametrize("mtu", [0, 1280, 9000])
def test_the_default_bucket_is_one_frame(mtu):
    link = netns.LinkOptions(gbps=0.1, mtu=mtu)
    frame = (mtu or netns.KERNEL_MTU) + netns.ETHERNET_HEADER
    assert link.frame_bytes() == frame
    assert link.burst_bytes() == frame
    assert link.record()["burst_bytes"] == frame
    assert link.describe() == "0.1 Gbit/s each way per host" + (
        f", {mtu}-byte frames" if mtu else "")
    tbf = netns.shaper_commands("ns", "eth0", link)[0]
    assert tbf[tbf.index("burst") + 1] == str(frame), tbf
    # Whatever the rate: no credit beyond the frame on the wire.
    assert netns.LinkOptions(gbps=8.0, mtu=mtu).burst_bytes() == frame


def test_an_explicit_bucket_overrides_the_frame():
    link = netns.LinkOptions(gbps=0.154, burst_kb=20)
    assert link.burst_bytes() == 20_000 and link.record()["burst_bytes"] == 20_000
    assert netns.LinkOptions().record()["burst_bytes"] is None


def test_the_tos_match_is_the_checkpoint_channel_s_class():
    from capricorn_jax import LOW_PRIORITY_TOS

    assert LOW_PRIORITY_TOS & netns.TOS_MASK == LOW_PRIORITY_TOS
    for ecn in range(4):  # TCP's ECN bits do not move a frame out of its class
        assert (LOW_PRIORITY_TOS | ecn) & netns.TOS_MASK == LOW_PRIORITY_TOS


def _filters(commands):
    return [argv for argv in commands if argv[3] == "filter"]


def test_priority_sorts_by_the_tos_byte_on_both_shapers():
    net = netns.ShapedNetwork(3, netns.LinkOptions(gbps=0.1, traffic_class="priority"),
                              job="cjx1")
    for host in range(3):
        commands = net.shaper_commands(host)
        ends = net.shapers(host)
        assert ends == [(f"cjx1h{host}", "eth0"), ("cjx1s", f"h{host}")]
        for namespace, dev in ends:
            mine = [argv for argv in commands if argv[2] == namespace and dev in argv]
            assert mine[0][3:] == ["qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
                                   "rate", "100mbit", "burst", "1514", "latency", "100ms"]
            text = [" ".join(argv[3:]) for argv in mine]
            assert f"qdisc add dev {dev} parent 1:1 handle 10: htb default 1" in text
            assert any(t.startswith(f"class add dev {dev} parent 10: classid 10:1 htb")
                       and " prio 0 " in t for t in text), text
            assert any(t.startswith(f"class add dev {dev} parent 10: classid 10:2 htb")
                       and " prio 1 " in t for t in text), text
            (tos,) = _filters(mine)
            assert " ".join(tos[3:]) == (f"filter add dev {dev} parent 10: protocol ip prio 1 "
                                         "u32 match ip tos 0x08 0xfc flowid 10:2")
            assert not any("pfifo_fast" in argv for argv in mine)
    # A rate change touches the tbfs alone and keeps their children.
    changed = net.shaper_commands(1, "change", 0.05)
    assert [argv[2] for argv in changed] == ["cjx1h1", "cjx1s"]
    assert all(argv[3:5] == ["qdisc", "change"] and "50mbit" in argv for argv in changed)


def test_the_filler_is_a_third_band_below_the_checkpoint_s_on_both_shapers():
    from capricorn_jax import LOW_PRIORITY_TOS
    from launch.cluster.filler import FILLER_TOS

    for ecn in range(4):  # distinct classes whatever TCP's ECN bits say
        assert (FILLER_TOS | ecn) & netns.TOS_MASK == FILLER_TOS != LOW_PRIORITY_TOS
    link = netns.LinkOptions(gbps=0.1, traffic_class="priority", filler=True)
    assert link.record()["filler"] is True
    assert link.describe().endswith("low-priority class, kept busy by a lowest-band filler")
    assert netns.LinkOptions(gbps=0.1, traffic_class="priority").record()["filler"] is False
    net = netns.ShapedNetwork(2, link, job="cjx1")
    for namespace, dev in net.shapers(1):
        text = [" ".join(argv[3:]) for argv in net.shaper_commands(1)
                if argv[2] == namespace and dev in argv]
        assert any(t.startswith(f"class add dev {dev} parent 10: classid 10:3 htb")
                   and " prio 2 " in t for t in text), text
        assert f"qdisc add dev {dev} parent 10:3 handle 13: pfifo limit 1000" in text
        assert [t for t in text if t.startswith("filter")] == [
            f"filter add dev {dev} parent 10: protocol ip prio 1 u32 match ip tos {tos} 0xfc "
            f"flowid 10:{band}" for tos, band in (("0x08", 2), ("0x04", 3))]


def test_a_filler_that_cannot_start_is_named_and_none_is_left_running():
    from launch.cluster import filler

    # The "namespace" prefix runs an interpreter that exits with a reason.
    prefix = [sys.executable, "-c", "import sys; sys.exit('no such namespace')"]
    with pytest.raises(RuntimeError, match=r"host 0's filler did not start within 5s "
                                           r"\(no such namespace\)"):
        filler.start([prefix, prefix], ["10.0.0.1", "10.0.0.2"], timeout_s=5)
    # One that never answers is bounded by the timeout, and stopped.
    silent = [sys.executable, "-c", "import time; time.sleep(60)"]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"host 0's filler did not start within 1s "
                                           r"\(no answer\)"):
        filler.start([silent], ["10.0.0.1"], timeout_s=1)
    assert time.monotonic() - t0 < 30


def test_a_fifo_link_with_the_filler_keeps_its_one_queue_above_the_filler_s():
    link = netns.LinkOptions(gbps=0.1, filler=True)
    text = [" ".join(argv[3:]) for argv in netns.shaper_commands("ns", "eth0", link)]
    limit = round(0.1e9 / 8 * 0.1) + link.frame_bytes()  # the tbf's own 100 ms queue
    assert text[1:] == [
        "qdisc add dev eth0 parent 1:1 handle 10: htb default 1",
        f"class add dev eth0 parent 10: classid 10:1 htb rate 100gbit burst 1mb cburst 1mb "
        f"prio 0 quantum {link.frame_bytes()}",
        f"qdisc add dev eth0 parent 10:1 handle 11: bfifo limit {limit}",
        f"class add dev eth0 parent 10: classid 10:3 htb rate 100gbit burst 1mb cburst 1mb "
        f"prio 2 quantum {link.frame_bytes()}",
        "qdisc add dev eth0 parent 10:3 handle 13: pfifo limit 1000",
        "filter add dev eth0 parent 10: protocol ip prio 1 u32 match ip tos 0x04 0xfc "
        "flowid 10:3"]
    assert link.describe() == "0.1 Gbit/s each way per host, kept busy by a lowest-band filler"


def test_fifo_links_are_one_queue_under_the_tbf():
    net = netns.ShapedNetwork(2, netns.LinkOptions(gbps=0.1), job="cjx1")
    commands = net.shaper_commands(0)
    assert len(commands) == 2, commands
    assert all("tbf" in argv and "htb" not in argv for argv in commands), commands


def test_bad_shaper_arguments_are_named():
    link = netns.LinkOptions(gbps=0.1)
    with pytest.raises(ValueError, match="verb must be 'add' or 'change', got 'replace'"):
        netns.shaper_commands("ns", "eth0", link, "replace")
    with pytest.raises(ValueError, match="rate must be > 0 Gbit/s, got 0"):
        netns.shaper_commands("ns", "eth0", link, "change", 0.0)


def _tc_counts(namespace: str, dev: str) -> tuple[int, int, int]:
    """(bytes sent, frames sent, frames dropped) of the root qdisc."""
    shown = " ".join(subprocess.run(["tc", "-s", "-n", namespace, "qdisc", "show", "dev", dev],
                                    capture_output=True, text=True, check=True).stdout.split())
    sent = shown.split("Sent ", 1)[1].split()
    dropped = shown.split("(dropped ", 1)[1].split(",")[0]
    return int(sent[0]), int(sent[2]), int(dropped)


@needs_root
def test_a_one_frame_bucket_carries_a_tcp_stream_in_full_frames():
    """The default bucket is smaller than the veths' GSO packets (up to
    64 KB): tbf cuts each into frames as it queues it, none is dropped, and a
    TCP stream arrives whole."""
    link = netns.LinkOptions(gbps=0.5)
    size = 2 << 20
    with netns.ShapedNetwork(2, link) as net:
        server = subprocess.Popen(
            [*net.command_prefix(1), sys.executable, "-c",
             "import socket, sys; s = socket.create_server((sys.argv[1], 9413)); "
             "print('ready', flush=True); c, _ = s.accept(); n = 0\n"
             "while (b := c.recv(1 << 16)): n += len(b)\n"
             "print(n)", net.address(1)], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            subprocess.run(
                [*net.command_prefix(0), sys.executable, "-c",
                 "import socket, sys; c = socket.create_connection((sys.argv[1], 9413), 30); "
                 f"c.sendall(bytes({size})); c.close()", net.address(1)],
                check=True, timeout=120)
            assert int(server.communicate(timeout=120)[0]) == size
        finally:
            server.kill()
        for end in (net.shapers(0)[0], net.shapers(1)[1]):  # the stream's two shapers
            sent, frames, dropped = _tc_counts(*end)
            assert dropped == 0 and sent >= size, (end, sent, frames, dropped)
            assert sent / frames <= link.frame_bytes(), (end, sent, frames)


# --- a real link: a probe past a backlog of checkpoint bytes ------------------------------------

PROBE_BYTES = 64
BULK_PORT, PROBE_PORT = 9411, 9412

SERVER = f"""
import socket, sys, threading, time
host, size = sys.argv[1], int(sys.argv[2])
def discard(c):
    while c.recv(1 << 16):
        pass
def bulk():
    s = socket.create_server((host, {BULK_PORT}))
    while True:
        threading.Thread(target=discard, args=(s.accept()[0],), daemon=True).start()
threading.Thread(target=bulk, daemon=True).start()
probe = socket.create_server((host, {PROBE_PORT}))
print("ready", flush=True)
c, _ = probe.accept()
while True:
    data = b""
    while len(data) < size:
        data += c.recv(size - len(data)) or sys.exit(0)
    print(time.monotonic_ns(), flush=True)
"""

PROBE = f"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], {PROBE_PORT}), 30)
size = int(sys.argv[2])
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
print("ready", flush=True)
for _ in sys.stdin:
    t = time.monotonic_ns()
    c.sendall(bytes(size))
    print(t, flush=True)
"""

BULK = f"""
import socket, sys, threading
def send(address):
    s = socket.socket()
    s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, int(sys.argv[1], 0))
    s.connect((address, {BULK_PORT}))
    block = bytes(1 << 20)
    while True:
        s.sendall(block)
threads = [threading.Thread(target=send, args=(a,), daemon=True) for a in sys.argv[2:]]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


def _band_stats(namespace: str, dev: str, handle: str) -> str:
    """``tc -s``'s lines of a band's queue (``12:`` the checkpoint's, ``13:`` the filler's)."""
    shown = subprocess.run(["tc", "-s", "-n", namespace, "qdisc", "show", "dev", dev],
                           capture_output=True, text=True, check=True).stdout
    return shown.split(f"qdisc pfifo {handle} ", 1)[1].split("qdisc ", 1)[0]


def _low_band_frames(namespace: str, dev: str) -> int:
    """Frames queued in the low band (qdisc 12:) of a priority shaper."""
    backlog = _band_stats(namespace, dev, "12:").split("backlog ", 1)[1].split()
    return int(backlog[1].rstrip("p"))


def _band_sent(namespace: str, dev: str, handle: str) -> int:
    """Bytes a band's queue sent."""
    return int(_band_stats(namespace, dev, handle).split("Sent ", 1)[1].split()[0])


def _start_in(net, procs: list, host: int, code: str, *args: str, stdin=None):
    """``python -c code args`` in host ``host``'s namespace, its stdout a text
    pipe; kept in ``procs``."""
    proc = subprocess.Popen([*net.command_prefix(host), sys.executable, "-c", code, *args],
                            stdin=stdin, stdout=subprocess.PIPE, text=True)
    procs.append(proc)
    return proc


def _probe_delays(server, probe, count: int, before=None) -> list[float]:
    """One-way delays (s) of ``count`` probes host 0 -> host 1, one at a time."""
    delays = []
    for _ in range(count):
        if before is not None:
            before()
        probe.stdin.write("go\n")
        probe.stdin.flush()
        sent = int(probe.stdout.readline())
        line = server.stdout.readline()
        assert line, "the probe's receiver ended"
        delays.append((int(line) - sent) / 1e9)
        time.sleep(0.02)
    return delays


@needs_root
@pytest.mark.slow
@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_a_default_class_probe_passes_a_checkpoint_backlog_on_both_shapers():
    """Three hosts at 0.05 Gbit/s with the priority class. Checkpoint-class
    bulk (TOS 0x08: host 0 -> 1 and 2, host 2 -> 1) fills both shapers a
    probe 0 -> 1 crosses: host 0's eth0 (its flows share its rate) and the
    switch's h1 (a 2-to-1 incast). A 64-byte probe of the default class then
    arrives within a few frames' time of its delay on idle links, where a
    FIFO at either end would hold it behind that end's queued frames (the
    test asserts each end's backlog is twice the bound). With the switch's
    end a pfifo_fast, the layout before the bands read the TOS byte, it
    fails: the probe waited behind h1's backlog (13-33 ms against a bound of
    1.5 ms)."""
    from capricorn_jax import LOW_PRIORITY_TOS

    link = netns.LinkOptions(gbps=0.05, traffic_class="priority")
    frame_s = link.frame_bytes() * 8 / (link.gbps * 1e9)
    # Per shaper: the low frame tbf may already hold, the probe's own frame and
    # a frame's time of timer and wake-up lateness; twice, for the two shapers.
    bound_s = 2 * 3 * frame_s
    procs: list[subprocess.Popen] = []
    with netns.ShapedNetwork(3, link) as net:
        def start(host, code, *args, stdin=None, net=net):
            return _start_in(net, procs, host, code, *args, stdin=stdin)

        try:
            server = start(1, SERVER, net.address(1), str(PROBE_BYTES))
            assert server.stdout.readline().strip() == "ready"
            other = start(2, SERVER, net.address(2), str(PROBE_BYTES))
            assert other.stdout.readline().strip() == "ready"
            probe = start(0, PROBE, net.address(1), str(PROBE_BYTES), stdin=subprocess.PIPE)
            assert probe.stdout.readline().strip() == "ready"
            idle = _probe_delays(server, probe, 7)

            low = hex(LOW_PRIORITY_TOS)
            # Several flows: TCP's small queues keep a flow's own
            # bytes in its host's qdisc to a few frames at this rate.
            start(0, BULK, low, *[net.address(1)] * 2, *[net.address(2)] * 4)
            start(2, BULK, low, net.address(1), net.address(1))
            ends = net.shapers(0)[:1] + net.shapers(1)[1:]  # host 0's eth0, the switch's h1
            backlog = {end: [] for end in ends}
            want = 2 * bound_s / frame_s  # either end a FIFO: the probe takes 2x the bound
            deadline = time.monotonic() + 30
            while not all(_low_band_frames(*end) >= want for end in ends):
                assert time.monotonic() < deadline, {e: _low_band_frames(*e) for e in ends}
                time.sleep(0.05)

            def sample():
                for end in ends:
                    backlog[end].append(_low_band_frames(*end))

            busy = _probe_delays(server, probe, 7, before=sample)
        finally:
            for proc in procs:
                proc.kill()
            for proc in procs:
                proc.wait(timeout=30)
    report = (f"idle {[round(d * 1e3, 2) for d in idle]} ms, busy "
              f"{[round(d * 1e3, 2) for d in busy]} ms, bound +{bound_s * 1e3:.2f} ms, "
              f"low-band frames before each probe {backlog}")
    print(report)
    for end, frames in backlog.items():
        assert statistics.median(frames) >= want, (end, report)
    assert statistics.median(busy) <= statistics.median(idle) + bound_s, report


@needs_root
@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_the_filler_makes_a_frame_pay_its_time_and_yields_to_both_classes():
    """Two hosts at 0.01 Gbit/s with the priority class. A probe of one
    frame crosses an idle link in less than its time on the wire (tbf sends
    it on the credit its one-frame bucket gathered: what ``--link_filler``
    removes); with the filler it pays at least that time and at most the
    filler's frame and its own per shaper (and a frame of timer lateness). The
    filler's frames flow on both of the probe's shapers, and a checkpoint-class
    stream takes the link from it. On the code before ``--link_filler`` (no
    filler) every probe crosses in under a frame's time."""
    from capricorn_jax import LOW_PRIORITY_TOS

    size = 1400  # one frame's payload at the kernel's MTU (with TCP's timestamps)
    delays, shares = {}, {}
    for busy in (False, True):
        link = netns.LinkOptions(gbps=0.01, traffic_class="priority", filler=busy)
        rate = link.gbps * 1e9 / 8
        frame_s, link_frame_s = (size + 66) / rate, link.frame_bytes() / rate
        bound_s = 2 * (2 * link_frame_s + frame_s)
        procs: list[subprocess.Popen] = []
        with netns.ShapedNetwork(2, link) as net:
            def start(host, code, *args, stdin=None, net=net, procs=procs):
                return _start_in(net, procs, host, code, *args, stdin=stdin)

            ends = net.shapers(0)[:1] + net.shapers(1)[1:]  # host 0's eth0, the switch's h1
            try:
                server = start(1, SERVER, net.address(1), str(size))
                assert server.stdout.readline().strip() == "ready"
                probe = start(0, PROBE, net.address(1), str(size), stdin=subprocess.PIPE)
                assert probe.stdout.readline().strip() == "ready"
                filled = [_band_sent(*end, "13:") if busy else 0 for end in ends]
                delays[busy] = _probe_delays(server, probe, 9)
                if busy:
                    assert all(_band_sent(*end, "13:") - n > 20 * link.frame_bytes()
                               for end, n in zip(ends, filled, strict=True))
                    start(0, BULK, hex(LOW_PRIORITY_TOS), net.address(1))
                    time.sleep(1.0)  # the stream's window opens
                    before = [_band_sent(*ends[0], band) for band in ("12:", "13:")]
                    time.sleep(2.0)
                    after = [_band_sent(*ends[0], band) for band in ("12:", "13:")]
                    shares["checkpoint"], shares["filler"] = (
                        a - b for a, b in zip(after, before, strict=True))
            finally:
                for proc in procs:
                    proc.kill()
                for proc in procs:
                    proc.wait(timeout=30)
            # The fillers end with the network.
            fillers = list(net._fillers)
        assert not any(p.poll() is None for p in fillers)
        assert len(fillers) == (2 if busy else 0)
    report = (f"idle {[round(d * 1e3, 2) for d in delays[False]]} ms, filled "
              f"{[round(d * 1e3, 2) for d in delays[True]]} ms, a frame {frame_s * 1e3:.2f} ms, "
              f"bound {bound_s * 1e3:.2f} ms; bytes in 2 s with a checkpoint stream {shares}")
    print(report)
    assert statistics.median(delays[False]) < frame_s, report
    # Every probe but at most one found the link sending (one filler flow: 2 of 9 did not).
    assert sum(d < frame_s for d in delays[True]) <= 1, report
    assert statistics.median(delays[True]) <= bound_s, report
    assert shares["checkpoint"] >= 0.9 * (shares["checkpoint"] + shares["filler"]), report
