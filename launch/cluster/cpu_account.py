"""CPU time of this process by thread group: where a strategy's CPU goes.

On the simulated cluster the hosts' processes share the box's cores with the
training step, so every CPU second a checkpoint strategy spends outside the
step's compute is a second the step may lose. The bench samples these
counters around each timed step (``launch.bench``'s ``cpu_ms_per_step``).

Source: ``/proc/self/task/<tid>/schedstat`` (each live thread's time on a
CPU, in nanoseconds; its name from ``comm``) and ``time.process_time()`` (the
whole process, exited threads included, also in nanoseconds). Python threads
are told apart by their ``native_id`` and name; XLA's compute pool by its
thread name. Design choice: the scheduler's nanosecond counters, not the
user + system clock ticks of ``/proc/<tid>/stat``: a tick is 10 ms per thread,
far above a small model's writes per step, so the store writers of ``tiny``
read 0 in some runs. Where a kernel has no schedstat (built without
CONFIG_SCHED_INFO) the ticks are read instead, and ``RESOLUTION_S`` says so.

Linux only; elsewhere ``sample`` returns None and the bench records nothing.
"""

from __future__ import annotations

import os
import threading
import time

GROUPS = ("main", "xla_compute", "runtime", "ckpt_writers", "chunk_sender", "chunk_receiver",
          "py_other", "exited")
"""main: the training thread (dispatch, host callbacks run elsewhere); xla_compute:
XLA:CPU's compute pool; runtime: other native threads (XLA's runtime and host
callbacks, gloo's collectives); ckpt_writers: the checkpointer's store writers;
chunk_sender / chunk_receiver: the threaded chunk path; py_other: other Python
threads; exited: threads that ended between two samples (the process total
minus the live threads)."""

_PY_GROUPS = (("ckpt-", "ckpt_writers"), ("chunk-sender", "chunk_sender"),
              ("chunk-receiver", "chunk_receiver"))


_SCHEDSTAT = os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat")
RESOLUTION_S = 1e-9 if _SCHEDSTAT else 1.0 / os.sysconf("SC_CLK_TCK")
"""The smallest CPU time a thread's sample can show (seconds)."""


def _thread_cpu(task: str) -> tuple[str, float] | None:
    """(thread name, CPU seconds) of one ``/proc/self/task/<tid>`` folder;
    None if the thread is gone."""
    try:
        if _SCHEDSTAT:
            with open(f"{task}/comm") as f:
                comm = f.read().rstrip("\n")
            with open(f"{task}/schedstat") as f:
                return comm, int(f.read().split()[0]) * 1e-9
        with open(f"{task}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    close = stat.rindex(")")
    fields = stat[close + 2:].split()  # from field 3 (state) on
    return stat[stat.index("(") + 1:close], (int(fields[11]) + int(fields[12])) * RESOLUTION_S


def _group(tid: int, comm: str, names: dict[int, str]) -> str:
    if tid == os.getpid():
        return "main"
    if tid in names:
        name = names[tid]
        return next((g for prefix, g in _PY_GROUPS if name.startswith(prefix)), "py_other")
    return "xla_compute" if "XLAEigen" in comm else "runtime"


def sample() -> dict[str, float] | None:
    """Seconds of CPU this process has used so far, per group of ``GROUPS``
    (``exited``: what threads no longer alive used). None off Linux."""
    if not os.path.exists("/proc/self/task"):
        return None
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out = dict.fromkeys(GROUPS, 0.0)
    for entry in os.listdir("/proc/self/task"):
        got = _thread_cpu(f"/proc/self/task/{entry}")
        if got is not None:
            out[_group(int(entry), got[0], names)] += got[1]
    out["exited"] = max(0.0, time.process_time() - sum(out.values()))
    return out


def delta(before: dict[str, float] | None, after: dict[str, float] | None) -> list[float]:
    """after - before per group, in ``GROUPS`` order (zeros when not sampled)."""
    if before is None or after is None:
        return [0.0] * len(GROUPS)
    return [after[g] - before[g] for g in GROUPS]
