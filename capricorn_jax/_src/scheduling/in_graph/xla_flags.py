"""The XLA:GPU flags the in-graph transfer path needs, set before the backend starts.

The in-graph path (``executor.InStepSender``) puts each chunk's
collective-permute at a layer boundary and relies on XLA:GPU to run it on a
communication stream while the next layer computes. Two settings decide it:

* ``--xla_gpu_enable_latency_hiding_scheduler=true``: the scheduler that moves
  an async collective's start early and its done late around independent
  compute; OpenXLA lists it among the passes not on by default. Without it,
  each start is followed almost at once by its done and the step waits for
  the bytes.
* ``--xla_gpu_enable_highest_priority_async_stream=true``: the collectives'
  stream gets the highest priority, so a long layer's kernels do not starve
  the permute's kernel.
* ``--xla_gpu_collective_permute_combine_threshold_bytes=0``: no combining of
  permutes. Measured on an sm_90 compile of the in-graph step without a GPU
  (``launch/gpu_bench.py``, schedule part): with XLA's default, ten of the
  twelve chunks' permutes became one combined permute after the backward
  pass, every window lost.

and two must not be undone by the user's own flags:
``--xla_gpu_disable_async_collectives`` must not list COLLECTIVEPERMUTE (that
turns the permute synchronous, on the compute stream), and
``--xla_gpu_disable_multi_streaming`` must not be true. The names are those of
jaxlib 0.10.2's XLA (its DebugOptions; an unknown name in ``XLA_FLAGS`` aborts
the backend's start, which ``tests/test_hlo_schedule_flags.py`` relies on).

XLA reads ``XLA_FLAGS`` once, when the first backend starts: ``set_overlap_flags``
adds the missing flags to the environment then (an explicit setting of the
user's wins, and is reported); called later it only checks and reports.
Alternative not taken: per-compile ``compiler_options`` on ``jax.jit``, which
would have to reach every jitted step of every strategy, and still leave the
training step without them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

log = logging.getLogger("capricorn_jax")

OVERLAP_FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_highest_priority_async_stream": "true",
    "xla_gpu_collective_permute_combine_threshold_bytes": "0",
}


def parse_xla_flags(text: str) -> dict[str, str]:
    """{name: value} of an ``XLA_FLAGS`` string ("--a=1 --b" -> {"a": "1", "b": "true"})."""
    out: dict[str, str] = {}
    for token in text.split():
        if not token.startswith("--"):
            raise ValueError(f"XLA_FLAGS entry {token!r} does not start with --")
        name, _, value = token[2:].partition("=")
        out[name] = value if _ else "true"
    return out


def overlap_problems(flags: dict[str, str]) -> list[str]:
    """What in ``flags`` keeps the in-graph path's permutes from overlapping
    compute on a GPU (empty: nothing)."""
    problems = []
    for name, want in OVERLAP_FLAGS.items():
        got = flags.get(name)
        if got is None:
            problems.append(f"--{name} is not set (want {want})")
        elif got.lower() != want:
            problems.append(f"--{name}={got} (want {want})")
    disabled = {x.strip().upper() for x in flags.get("xla_gpu_disable_async_collectives",
                                                      "").split(",") if x.strip()}
    if disabled & {"COLLECTIVEPERMUTE", "ALL"}:
        problems.append("--xla_gpu_disable_async_collectives makes collective-permutes "
                        f"synchronous ({','.join(sorted(disabled))})")
    if flags.get("xla_gpu_disable_multi_streaming", "false").lower() in ("true", "1"):
        problems.append("--xla_gpu_disable_multi_streaming=true puts collectives on the "
                        "compute stream")
    return problems


def with_overlap_flags(text: str) -> tuple[str, list[str]]:
    """``text`` with the missing OVERLAP_FLAGS added; the user's explicit
    settings stay. Returns (new XLA_FLAGS, problems left after adding)."""
    flags = parse_xla_flags(text)
    added = [f"--{n}={v}" for n, v in OVERLAP_FLAGS.items() if n not in flags]
    new = " ".join([text.strip(), *added]).strip()
    return new, overlap_problems(parse_xla_flags(new))


def backend_started() -> bool:
    """Whether a JAX backend has started (XLA_FLAGS already read)."""
    try:
        from jax._src import xla_bridge
    except ImportError:
        return False
    return bool(getattr(xla_bridge, "_backends", None))


def set_overlap_flags(environ: MutableMapping[str, str] | None = None,
                      started: bool | None = None) -> list[str]:
    """Adds OVERLAP_FLAGS to ``environ["XLA_FLAGS"]`` (default ``os.environ``)
    if no backend has started yet; logs and returns the problems left (flags
    a started backend never saw, or the user's settings against them).
    Harmless on CPU (XLA:CPU ignores the GPU options)."""
    environ = os.environ if environ is None else environ
    started = backend_started() if started is None else started
    current = environ.get("XLA_FLAGS", "")
    if started:
        problems = overlap_problems(parse_xla_flags(current))
        if problems:
            problems = [f"the backend started before set_overlap_flags: {p}" for p in problems]
    else:
        new, problems = with_overlap_flags(current)
        environ["XLA_FLAGS"] = new
    for p in problems:
        log.warning("in-graph transfers may not overlap compute on GPU: %s", p)
    return problems
