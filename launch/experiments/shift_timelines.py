"""Timelines of a step before and after a load shift, gemini's schedule against capricorn's.

    python -m launch.experiments.shift_timelines --gemini=W1 --capricorn=W2 \\
        --before=S1 --after=S2 --out_dir=DIR

W1 and W2 are the WORKDIRs of two ``launch.train`` runs with the same seed and
workload (the same batches, so the same expert load at every step), one with
``--ckpt=gemini``, one with ``--ckpt=capricorn``. Steps S1 and S2 are profiled steps
(a ``profile`` event
in W2, or in ``--profiles=W3``: e.g. a ``--ckpt=none --profile=every`` run
of the same seed and workload, when capricorn did not profile after the
shift), S1 before a shift and S2 after it. For each strategy and step the tool draws the
measured layers
of that profiled step against the schedule that strategy had in force during
it (its last ``repartition`` before the step), as ``launch.train --timeline``
draws one step: chunks that outlast their window are red (overflow).

Gemini never profiles after its first steps, so its picture after the shift
uses another run's profile of that step: the layers its fixed schedule meets
there (the same batch and load; a profiled step moves no chunks).

Schedules are rebuilt from the ``repartition`` events (windows measured, the
link model, the payload) with the partitioner and the strategy's safety
margin; a rebuilt schedule whose bytes per window differ from the event's
(beyond the event's rounding of durations to 1 us) stops the tool (it would draw another
schedule than the one that ran).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import app, flags

FLAGS = flags.FLAGS
MARGIN = 0.8  # scheduling.transfers.ScheduledTransfers' default


def define_flags() -> None:
    flags.DEFINE_string("gemini", None, "WORKDIR of the --ckpt=gemini run.")
    flags.DEFINE_string("capricorn", None, "WORKDIR of the --ckpt=capricorn run.")
    flags.DEFINE_string("profiles", None,
                        "WORKDIR of the run whose profiled steps are drawn (default: the "
                        "capricorn run's), e.g. a --ckpt=none --profile=every run of the same "
                        "seed and workload.")
    flags.DEFINE_integer("before", None, "A profiled step before the shift.")
    flags.DEFINE_integer("after", None, "A profiled step after the shift.")
    flags.DEFINE_integer("chunk_cap", 4 << 20, "The runs' --chunk_cap_bytes (else --chunk_bytes).")
    flags.DEFINE_string("out_dir", ".", "Where the PNGs and trace JSONs go.")


def _records(workdir: str) -> list[dict]:
    return [json.loads(x) for x in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def profile_at(records: list[dict], step: int):
    """The LayerProfile of profiled step ``step`` (the last such event: a rerun's)."""
    from capricorn_jax import LayerProfile
    from capricorn_jax.experimental import Segment

    events = [r for r in records if r.get("event") == "profile" and r["step"] == step]
    if not events:
        steps = sorted({r["step"] for r in records if r.get("event") == "profile"})
        raise ValueError(f"no profile of step {step}; profiled steps: {steps}")
    e = events[-1]
    segments = tuple(Segment(s["name"], s["direction"], s["start_s"], s["duration_s"],
                             s["collective_s"]) for s in e["layers"])
    return LayerProfile(step, e["total_s"], segments, e.get("devices", 1),
                        e.get("mark_cost_s", 0.0))


def schedule_in_force(records: list[dict], step: int, chunk_cap: int):
    """The schedule a run had in force during step ``step`` (rebuilt), or None."""
    from capricorn_jax.experimental import (
        LinkModel,
        Window,
        partition,
        scale_windows,
        windows_from_profile,
    )

    reparts = [r for r in records if r.get("event") == "repartition" and r["step"] < step]
    if not reparts:
        return None
    e = reparts[-1]
    names = windows_from_profile(profile_at(records, e["step"]))
    if len(names) != len(e["windows_s"]):
        raise ValueError(f"repartition at step {e['step']}: {len(e['windows_s'])} windows, "
                         f"its profile has {len(names)}")
    windows = [Window(w.name, w.direction, d) for w, d in zip(names, e["windows_s"], strict=True)]
    payload = sum(e["window_bytes"]) + e["tail_bytes"]
    schedule = partition(payload, scale_windows(windows, MARGIN),
                         LinkModel(e["link_alpha_s"], e["link_bytes_per_s"]), chunk_cap)
    got = [schedule.bytes_in_window(i) for i in range(len(schedule.windows))]
    # The event rounds window durations to 1 us: a window may gain or lose
    # the bytes of 1 us (x the margin) on the link.
    slack = int(2e-6 * e["link_bytes_per_s"]) + 1
    if (any(abs(a - b) > slack for a, b in zip(got, e["window_bytes"], strict=True))
            or abs(schedule.tail_bytes - e["tail_bytes"]) > slack * len(got)):
        raise ValueError(f"repartition at step {e['step']}: rebuilt window bytes {got} + tail "
                         f"{schedule.tail_bytes}, the run had {e['window_bytes']} + "
                         f"{e['tail_bytes']} (another --chunk_cap?)")
    return schedule


def main(argv: list[str]) -> None:
    del argv
    from capricorn_jax.experimental import timeline as timeline_lib
    from launch.plot_timeline import render

    runs = {"gemini": _records(FLAGS.gemini), "capricorn": _records(FLAGS.capricorn)}
    profiles = _records(FLAGS.profiles) if FLAGS.profiles else runs["capricorn"]
    out = Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for when, step in (("before", FLAGS.before), ("after", FLAGS.after)):
        profile = profile_at(profiles, step)
        for name, records in runs.items():
            schedule = schedule_in_force(records, step, FLAGS.chunk_cap)
            doc = timeline_lib.trace(profile, schedule, 0,
                                     title=f"{name}, step {step} ({when} the shift)")
            path = timeline_lib.write_trace(out / f"{name}_{when}_step{step}.json", doc)
            png = render(doc, path.with_suffix(".png"))
            over = [o["window"] for o in doc["metadata"]["overflows"]]
            print(f"{name} step {step} ({when}): {png}; windows overflowed: {over or 'none'}; "
                  f"tail {doc['metadata']['tail_bytes']} bytes", flush=True)


if __name__ == "__main__":
    define_flags()
    flags.mark_flags_as_required(["gemini", "capricorn", "before", "after"])
    try:
        app.run(main)
    except ValueError as e:
        sys.exit(f"shift_timelines: {e}")
