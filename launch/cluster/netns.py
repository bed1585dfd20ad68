"""Shaped links for the simulated cluster: each host in its own network namespace.

``--link_gbps=R`` (launch.train, launch.bench, launch.chaos) runs every
simulated host behind a link of R Gbit/s in each direction, the regime of a
real cluster where the all-to-alls and the checkpoint share a scarce link.
Without it the hosts talk over unshaped loopback (the default).

Layout of one job (names carry the supervisor's pid: ``cjx<pid>``):

- ``cjx<pid>s``: a switch namespace holding the bridge ``br0``;
- ``cjx<pid>h<i>``: host i's namespace; its veth ``eth0`` (address
  ``10.93.0.<i+1>/24``) is paired with ``h<i>`` in the switch, a bridge port;
- a ``tbf`` qdisc on ``eth0`` (what host i sends) and on ``h<i>`` (what it
  receives) at the rate asked for, its bucket one frame (``LinkOptions``);
  ``--link_latency_ms`` adds a ``netem`` delay (half on each end) where the
  kernel has netem; ``--traffic_class=priority`` puts a strict-priority child
  under each tbf that sorts by the IP header's TOS byte (``shaper_commands``),
  and ``--link_filler`` a third band below it that a stream from each host to
  the next keeps sending (``launch.cluster.filler``: a link that is never idle
  charges every frame its time on the wire, as a real one does);
- ``/etc/netns/cjx<pid>h<i>/hosts`` maps this machine's hostname to host i's
  address: gloo advertises the address its hostname resolves to, and
  ``ip netns exec`` bind-mounts that file over /etc/hosts for the worker.

Addresses exist only inside these namespaces (no route out, no NAT). Everything
is removed when the job ends (``ShapedNetwork.close``), when the supervisor is
killed (a guardian process, in its own session, removes them when the
supervisor's end of a pipe closes), and, for a run whose guardian died too,
on the next start (``remove_stale``: namespaces whose pid is gone).

Design choice: kernel namespaces and tc, so that gloo's real TCP traffic is
shaped. Alternative not taken: pacing inside the transport (sleeping between
chunks), which would shape only the checkpoint and leave the all-to-alls on an
unshaped link, the opposite of the contention being studied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from launch.cluster import filler

PREFIX = "cjx"
SUBNET = "10.93.0"
NETNS_ETC = Path("/etc/netns")
_NAME = re.compile(rf"{PREFIX}(\d+)([sh]\d*)$")


KERNEL_MTU = 1500
"""A veth's frame size unless ``--link_mtu`` sets one."""
MTU_RANGE = (1280, 65000)
"""``--link_mtu``: IPv6's minimum to what a veth takes with headroom to spare."""
ETHERNET_HEADER = 14
"""The bytes tbf counts in a frame beyond the MTU (the Ethernet header, no FCS)."""
TRAFFIC_CLASSES = ("fifo", "priority")
"""``--traffic_class``: one queue per link, or checkpoint bytes behind the rest."""
TOS_MASK = 0xFC
"""The TOS byte less its two ECN bits (which TCP may set on any segment): the
priority child matches ``capricorn_jax.LOW_PRIORITY_TOS`` under this mask."""
PRIORITY_BAND_PACKETS = 1000
"""Each band's queue under ``--traffic_class=priority``, in frames: what
``pfifo_fast`` held per band (a veth's txqueuelen) before the bands sorted by TOS."""
BAND_RATE = "100gbit"
"""The priority child's classes' own rate and bucket: far above what a veth
here carries, so that they only order frames and the tbf above them sets the rate."""
BAND_BURST = "1mb"
QUEUE_S = 0.1
"""What a shaper queues, in seconds of its rate (tbf's ``latency``; with the
filler on a FIFO link, its one band's byte limit)."""


class LinkError(RuntimeError):
    """Shaped links cannot be set up here; the message says why, on one line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkOptions:
    """A simulated host's link: ``gbps`` each way (0: unshaped loopback),
    ``latency_ms`` one way between two hosts (needs netem), and ``burst_kb``,
    the tbf bucket: how many KB a host may send at the machine's own speed
    after an idle spell (0: the default, one frame: ``frame_bytes``).

    ``mtu``: the veths' frame size (0: the kernel's 1500). tbf splits every
    GSO packet into frames of it, and each frame costs the hosts' shared cores
    a pass through veth, tbf and both TCP ends: a datacenter link's jumbo
    frames (9000) cut that per-byte kernel work about six-fold, and so the
    emulation's share of the cores that a real NIC would take off them.

    The bucket matters to this project's question: a real link has no credit
    beyond the frame on the wire, while a large bucket lets the bytes that
    follow an idle spell (here: the next all-to-all) pass at loopback speed,
    so any checkpoint byte sent in that idle spell costs the all-to-all its
    free ride and a strategy that sends in idle time looks cheaper than it
    would be on a real link. The default was max(256 KB, 2 ms of the rate)
    up to 0.20.0 (measured 2026-12-04 on the emulated 2x2 run at
    0.154 Gbit/s: none's all-to-alls took 128 ms per step with the 256 KB
    bucket, 220 ms with 20 KB; BUILD_NOTES.md "Shaped links"); it is now
    one frame, and ``--link_burst_kb`` sets another for an experiment. The
    price of one frame: tbf keeps no credit beyond its bucket, so the time
    between a frame's due time and the hrtimer that sends it is lost on
    every frame, a larger share of a frame's time the faster the link
    (``launch.link_probe`` one way on a loaded 2-core VM whose timers fire
    15-20 us late, 2026-12-06: 0.082 of 0.1 Gbit/s, 0.21 of 0.3, 0.41 of
    1.0; with ``--link_mtu=9000``, a sixth as many frames: 0.096, 0.27,
    0.82). The bench records the measured rate beside the requested one.
    """

    gbps: float = 0.0
    latency_ms: float = 0.0
    burst_kb: float = 0.0
    traffic_class: str = "fifo"
    mtu: int = 0
    filler: bool = False

    def __post_init__(self) -> None:
        if not self.gbps >= 0:
            raise ValueError(f"--link_gbps must be >= 0, got {self.gbps}")
        if not self.latency_ms >= 0:
            raise ValueError(f"--link_latency_ms must be >= 0, got {self.latency_ms}")
        if self.latency_ms and not self.gbps:
            raise ValueError("--link_latency_ms needs --link_gbps > 0 (the hosts' own links)")
        if self.mtu:
            if not self.gbps:
                raise ValueError("--link_mtu needs --link_gbps > 0 (the hosts' own links)")
            if not MTU_RANGE[0] <= self.mtu <= MTU_RANGE[1]:
                raise ValueError(f"--link_mtu must be 0 (the kernel's 1500) or in "
                                 f"{MTU_RANGE[0]}..{MTU_RANGE[1]}, got {self.mtu}")
        if self.burst_kb != 0 and not (math.isfinite(self.burst_kb)
                                       and round(self.burst_kb * 1000) >= self.frame_bytes()):
            # A bucket smaller than a frame never sends it: tbf drops the frame.
            mtu = f"--link_mtu={self.mtu}" if self.mtu else f"the kernel's MTU {KERNEL_MTU}"
            raise ValueError(f"--link_burst_kb must be 0 (one frame) or hold one frame of "
                             f"{self.frame_bytes()} bytes ({mtu} and the Ethernet header), "
                             f"got {self.burst_kb}")
        if self.burst_kb and not self.gbps:
            raise ValueError("--link_burst_kb needs --link_gbps > 0 (the hosts' own links)")
        if self.traffic_class not in TRAFFIC_CLASSES:
            raise ValueError(f"--traffic_class must be one of {', '.join(TRAFFIC_CLASSES)}, "
                             f"got {self.traffic_class!r}")
        if self.traffic_class == "priority" and not self.gbps:
            raise ValueError("--traffic_class=priority needs --link_gbps > 0 (the priority "
                             "queue sits on the hosts' shaped links)")
        if self.traffic_class == "priority" and self.latency_ms:
            raise ValueError("--traffic_class=priority and --link_latency_ms both need the "
                             "link's one child queue (the priority bands, netem): use one "
                             "of them")
        if self.filler and not self.gbps:
            raise ValueError("--link_filler needs --link_gbps > 0 (it keeps the hosts' shaped "
                             "links sending)")
        if self.filler and self.latency_ms:
            raise ValueError("--link_filler and --link_latency_ms both need the link's one "
                             "child queue (the filler's band, netem): use one of them")

    @property
    def shaped(self) -> bool:
        return self.gbps > 0

    def frame_bytes(self) -> int:
        """One full frame on the link as tbf counts it: the MTU and the Ethernet header."""
        return (self.mtu or KERNEL_MTU) + ETHERNET_HEADER

    def burst_bytes(self) -> int:
        """The tbf bucket in bytes: ``burst_kb``, or the default, one frame
        (``frame_bytes``; see the class)."""
        if self.burst_kb:
            return round(self.burst_kb * 1000)  # a float's lost last byte kept
        return self.frame_bytes()

    def record(self) -> dict:
        """What was asked for, as the JSONs of the bench and the link probe hold it."""
        return {"requested_gbps": self.gbps or None, "latency_ms": self.latency_ms,
                "burst_bytes": self.burst_bytes() if self.shaped else None,
                "traffic_class": self.traffic_class,
                "mtu": (self.mtu or KERNEL_MTU) if self.shaped else None,
                "filler": self.filler,
                "describe": self.describe()}

    def describe(self) -> str:
        if not self.shaped:
            return "unshaped loopback"
        lat = f", {self.latency_ms:g} ms one way" if self.latency_ms else ""
        burst = f", a {self.burst_bytes() / 1000:g} KB bucket" if self.burst_kb else ""
        frames = f", {self.mtu}-byte frames" if self.mtu else ""
        cls = (", checkpoint bytes in a low-priority class" if self.traffic_class == "priority"
               else "")
        busy = ", kept busy by a lowest-band filler" if self.filler else ""
        return f"{self.gbps:g} Gbit/s each way per host{lat}{burst}{frames}{cls}{busy}"


def own_mtu(record: dict | None) -> int | None:
    """A run's link record (``LinkOptions.record``, the bench JSON's ``link``):
    its frame size where it is not the kernel's, else None."""
    mtu = (record or {}).get("mtu")
    return mtu if mtu and mtu != KERNEL_MTU else None


def link_from_flags(fv: object) -> LinkOptions:
    """The link the parsed flags ask for (``--link_gbps``, ``--link_latency_ms``,
    ``--link_burst_kb``, ``--traffic_class``, ``--link_mtu``, ``--link_filler``);
    raises ValueError naming a bad one."""
    return LinkOptions(gbps=fv.link_gbps, latency_ms=fv.link_latency_ms,  # type: ignore[attr-defined]
                       burst_kb=fv.link_burst_kb,  # type: ignore[attr-defined]
                       traffic_class=fv.traffic_class,  # type: ignore[attr-defined]
                       mtu=fv.link_mtu,  # type: ignore[attr-defined]
                       filler=fv.link_filler)  # type: ignore[attr-defined]


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces(prefix: str = PREFIX) -> list[str]:
    """This machine's network namespaces whose names start with ``prefix``."""
    out = _run("ip", "netns", "list")
    return [line.split()[0] for line in out.splitlines()
            if line.strip() and line.split()[0].startswith(prefix)]


def _delete(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def job_namespaces(job: str) -> list[str]:
    """The namespaces of job ``job`` (``cjx<pid>``): its switch and hosts only,
    not those of a job whose pid merely starts with the same digits."""
    return [name for name in namespaces(job)
            if _NAME.match(name) and name[len(job):][:1] in ("s", "h")]


def remove_job(job: str) -> list[str]:
    """Deletes job ``job``'s namespaces (and their veths, qdiscs, hosts
    files); the names deleted."""
    gone = job_namespaces(job)
    for name in gone:
        _delete(name)
    for folder in NETNS_ETC.glob(f"{job}[sh]*") if NETNS_ETC.exists() else ():
        shutil.rmtree(folder, ignore_errors=True)
    return gone


def _stale(names) -> list[str]:
    return sorted(n for n in names if (m := _NAME.match(n)) and not pid_alive(int(m.group(1))))


def stale_namespaces() -> list[str]:
    """Namespaces of jobs whose supervisor is gone."""
    return _stale(namespaces())


def remove_stale() -> list[str]:
    """Deletes the namespaces (and hosts files) of jobs whose supervisor is
    gone (a crashed or SIGKILLed run whose guardian died too); the names deleted."""
    names = set(namespaces())
    if NETNS_ETC.exists():
        names |= {p.name for p in NETNS_ETC.iterdir()}
    gone = _stale(names)
    for name in gone:
        _delete(name)
    return gone


def check_available(options: LinkOptions) -> None:
    """Raises LinkError (one line: what is missing and what to do) unless this
    process can build shaped links."""
    if os.geteuid() != 0:
        raise LinkError("--link_gbps needs root (it creates network namespaces and tc qdiscs); "
                        "run as root, or leave --link_gbps at 0 for unshaped loopback")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LinkError(f"--link_gbps needs iproute2's `{tool}` on PATH; install iproute2")
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        _run("ip", "netns", "add", probe)
    except LinkError as e:
        raise LinkError(f"--link_gbps: network namespaces are unavailable here ({e})") from None
    try:
        _run("ip", "-n", probe, "link", "set", "lo", "up")
        _run("tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "tbf",
             "rate", "1gbit", "burst", "256kb", "latency", "100ms")
        if options.latency_ms:
            try:
                _run("tc", "-n", probe, "qdisc", "add", "dev", "lo", "parent", "1:1",
                     "handle", "10:", "netem", "delay", "1ms")
            except LinkError:
                raise LinkError(
                    "--link_latency_ms needs the kernel's netem qdisc (sch_netem), which this "
                    "kernel lacks; leave --link_latency_ms at 0 (rate shaping alone works)"
                ) from None
    except LinkError as e:
        if "--link" in str(e):
            raise
        raise LinkError(f"--link_gbps: tc's tbf qdisc is unavailable here ({e})") from None
    finally:
        _delete(probe)


def shaper_commands(namespace: str, dev: str, options: LinkOptions, verb: str = "add",
                    gbps: float | None = None) -> list[list[str]]:
    """The ``tc`` commands (argv lists, run in order) that shape ``dev`` in
    ``namespace``: a tbf of the link's rate (``gbps``: another rate) and
    bucket (``LinkOptions.burst_bytes``, a queue of 100 ms), and under it, for
    ``verb="add"``, the netem delay or the priority child. ``verb="change"``:
    the tbf's rate alone, its child kept.

    The priority child (``--traffic_class=priority``) is an htb of two classes
    that only order frames (``BAND_RATE``): 10:1, first, for everything, and
    10:2 for the frames whose IP header carries TOS
    ``capricorn_jax.LOW_PRIORITY_TOS`` (a ``u32`` filter on the header's byte,
    under ``TOS_MASK``); each a FIFO of ``PRIORITY_BAND_PACKETS`` frames. It
    reads the packet itself, so both ends of a link sort alike: ``pfifo_fast``,
    used before, sorts by ``skb->priority``, which the sender's socket sets
    from its TOS and the veth clears as a frame crosses into the switch, so
    the receiving end (``h<i>``) was one FIFO. A frame of the low class that
    tbf already holds (it peeks at the child) still leaves first: a frame of
    the high class waits for at most one low frame per shaper. (An htb rather
    than ``prio``: some kernels, this project's test machines among them,
    build htb and not prio.) ``--link_filler`` adds 10:3, last, for the
    filler's TOS (``launch.cluster.filler.FILLER_TOS``); on a FIFO link it is
    the one band under 10:1, which then holds what the tbf alone held.
    """
    if verb not in ("add", "change"):
        raise ValueError(f"shaper_commands: verb must be 'add' or 'change', got {verb!r}")
    rate = options.gbps if gbps is None else gbps
    if not rate > 0:
        raise ValueError(f"shaper_commands: the rate must be > 0 Gbit/s, got {rate}")
    tc = ["tc", "-n", namespace]
    commands = [[*tc, "qdisc", verb, "dev", dev, "root", "handle", "1:", "tbf",
                 "rate", f"{rate * 1000:g}mbit", "burst", str(options.burst_bytes()),
                 "latency", f"{QUEUE_S * 1000:g}ms"]]
    if verb != "add":
        return commands
    if options.latency_ms:
        commands.append([*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                         "netem", "delay", f"{options.latency_ms / 2:g}ms"])
    elif options.traffic_class == "priority" or options.filler:
        from capricorn_jax import LOW_PRIORITY_TOS

        sorted_out = [(band, tos) for band, tos, on in (
            (2, LOW_PRIORITY_TOS, options.traffic_class == "priority"),
            (3, filler.FILLER_TOS, options.filler)) if on]
        commands.append([*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                         "htb", "default", "1"])
        for band in (1, *(band for band, _ in sorted_out)):
            commands.append([*tc, "class", "add", "dev", dev, "parent", "10:",
                             "classid", f"10:{band}", "htb", "rate", BAND_RATE,
                             "burst", BAND_BURST, "cburst", BAND_BURST, "prio", str(band - 1),
                             "quantum", str(options.frame_bytes())])
            # A FIFO link's one queue holds what the tbf alone held (QUEUE_S of the rate).
            queue = (["bfifo", "limit",
                      str(round(rate * 1e9 / 8 * QUEUE_S) + options.burst_bytes())]
                     if band == 1 and options.traffic_class == "fifo"
                     else ["pfifo", "limit", str(PRIORITY_BAND_PACKETS)])
            commands.append([*tc, "qdisc", "add", "dev", dev, "parent", f"10:{band}",
                             "handle", f"1{band}:", *queue])
        for band, tos in sorted_out:
            commands.append([*tc, "filter", "add", "dev", dev, "parent", "10:", "protocol",
                             "ip", "prio", "1", "u32", "match", "ip", "tos", f"{tos:#04x}",
                             f"{TOS_MASK:#04x}", "flowid", f"10:{band}"])
    return commands


class ShapedNetwork:
    """The namespaces and links of one job of ``hosts`` hosts (a context manager).

    ``command_prefix(i)`` is what host i's process runs under, ``address(i)``
    its address (the coordinator listens on host 0's).
    """

    def __init__(self, hosts: int, options: LinkOptions, job: str | None = None):
        if not options.shaped:
            raise ValueError("ShapedNetwork needs LinkOptions with gbps > 0")
        self.hosts = hosts
        self.options = options
        self.job = job or f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.job}s"
        self._guardian: subprocess.Popen | None = None
        self._fillers: list[subprocess.Popen] = []
        self.stale_removed: list[str] = []

    def host_namespace(self, host: int) -> str:
        return f"{self.job}h{host}"

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def command_prefix(self, host: int) -> list[str]:
        return ["ip", "netns", "exec", self.host_namespace(host)]

    def shapers(self, host: int) -> list[tuple[str, str]]:
        """Host ``host``'s two shapers as (namespace, device): what it sends
        (``eth0`` in its namespace), what it receives (``h<i>`` in the switch's)."""
        return [(self.host_namespace(host), "eth0"), (self.switch, f"h{host}")]

    def shaper_commands(self, host: int, verb: str = "add",
                        gbps: float | None = None) -> list[list[str]]:
        """The ``tc`` commands of both of host ``host``'s shapers (``shaper_commands``)."""
        return [argv for namespace, dev in self.shapers(host)
                for argv in shaper_commands(namespace, dev, self.options, verb, gbps)]

    def open(self) -> ShapedNetwork:
        check_available(self.options)
        self.stale_removed = remove_stale()
        self._guardian = subprocess.Popen(
            [sys.executable, "-c", "import sys; from launch.cluster.netns import _guard; "
             "_guard(sys.argv[1])", self.job],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, cwd=Path(__file__).resolve().parents[2])
        try:
            self._build()
            if self.options.filler:
                self._fillers = filler.start(
                    [self.command_prefix(h) for h in range(self.hosts)],
                    [self.address(h) for h in range(self.hosts)])
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        hostname = socket.gethostname()
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host in range(self.hosts):
            ns = self.host_namespace(host)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth",
                 "peer", "name", f"h{host}", "netns", self.switch)
            if self.options.mtu:
                _run("ip", "-n", ns, "link", "set", "eth0", "mtu", str(self.options.mtu))
                _run("ip", "-n", self.switch, "link", "set", f"h{host}", "mtu",
                     str(self.options.mtu))
            _run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", self.switch, "link", "set", f"h{host}", "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", f"h{host}", "up")
            for argv in self.shaper_commands(host):
                _run(*argv)
            etc = NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{self.address(host)} {hostname}\n")

    def set_link(self, host: int, up: bool) -> None:
        """Host ``host``'s link at the switch up or down (down: a partition,
        both ways; its TCP connections stay open and resume when it is up)."""
        _run("ip", "-n", self.switch, "link", "set", f"h{host}", "up" if up else "down")

    def set_rate(self, host: int, gbps: float | None = None) -> None:
        """Host ``host``'s link rate, both ways (None: the job's own rate)."""
        for argv in self.shaper_commands(host, "change", gbps):
            _run(*argv)

    def close(self) -> None:
        if self._fillers:
            filler.stop(self._fillers)
            self._fillers = []
        remove_job(self.job)
        if self._guardian is not None:
            if self._guardian.stdin is not None:
                self._guardian.stdin.close()
            try:
                self._guardian.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._guardian.kill()
            self._guardian = None

    def __enter__(self) -> ShapedNetwork:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


def _guard(job: str) -> None:
    """The guardian: waits until its supervisor's pipe closes (the supervisor
    ended, however it ended), then deletes the job's namespaces."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # outlive the job's own signals
    try:
        sys.stdin.buffer.read()
    finally:
        remove_job(job)


@contextlib.contextmanager
def links_for(tool: str, hosts: int, options: LinkOptions) -> Iterator[ShapedNetwork | None]:
    """A command's shaped network for the length of the block (None when
    ``options`` is unshaped): one line says what the hosts run behind (and
    what a crashed run left that was removed); when links cannot be built
    here, ``tool: error: ...`` on one line and exit code 2."""
    if not options.shaped:
        yield None
        return
    try:
        network = ShapedNetwork(hosts, options).open()
    except LinkError as e:
        print(f"{tool}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        if network.stale_removed:
            print(f"links: removed {len(network.stale_removed)} namespaces left by a crashed "
                  f"run ({', '.join(network.stale_removed)})", flush=True)
        print(f"links: {hosts} hosts, each in its own network namespace behind "
              f"{options.describe()}", flush=True)
        yield network
    finally:
        network.close()
