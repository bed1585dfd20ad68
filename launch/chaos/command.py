r"""Randomized fault trials: ``python -m launch.chaos --trials=N --seed=S --json=PATH``.

Each trial draws a topology (2 hosts x 2 devices, 4 x 1, 4 x 1 with three
replicas), an in-memory strategy (inmem, gemini, capricorn, pec), with or
without a persistent tier (keeping 3 persistent steps, or 1 so that Orbax
deletes steps within the trial), and a fault schedule for ``launch.train
--fault_plan``: one or two faults, each killing one host or two at once at a
random step and point (after a step, while a step runs, halfway through
writing replicas, while the persistent tier writes, while the job recovers),
as a process (its RAM store survives) or a machine (its store is wiped), at
times with a corrupted chunk, every RAM store lost, or a replica writer that
stalls; or a fault that kills no host (a persistent write that fails or
hangs, a full disk at Orbax's finalize, a corrupted frame, a stalled
channel, a pause, a partition or a slow link). The draw is ``draw``.

The trial then checks the run (``checks``) against an uninterrupted
reference run of the same topology (``--ckpt=none``: a checkpoint does not
change training) and against the oracle (``oracle``): from the fault plan,
the replica placement and what the run recorded as committed (the memory
tier's safe versions, the persistent steps a watcher saw on disk while the
job ran: ``jobs``), the newest version that must survive each fault and the
tier it must come from (``expected_from`` in the JSON); a resumption from
anything older fails the trial, and so does a committed persistent step
deleted before ``max_to_keep`` newer ones were committed. A PEC trial that
restored (its losses after the restore differ from the uninterrupted run's
by design) is then compared with a second run of its job that takes the same
roll-backs without the faults (``pec_reference``): the same losses after
each roll-back and the same final state (``pec_reference`` in the JSON).

A progress line per trial, a table and a summary at the end; the JSON
(contract in DESIGN.md) has one object per trial with what was drawn, what
happened, what the oracle expected and the problems found. Exit code 1 if a
trial failed.

Design choice: a trial is a real ``launch.train`` job (real processes, real
kills by the supervisor's injector), and the decisions (``draw_trial``,
``check_trial``, the oracle) are pure functions of a seeded generator and
the recorded data, so a failed trial is replayed by its seed. Alternative
not taken: a fault injector inside the workers, which could not kill a
process from outside at a point the process does not choose.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import app, flags

from launch.chaos import jobs, pec_reference
from launch.chaos.checks import check_trial, committed_steps, expected, expected_json
from launch.chaos.config import (  # noqa: F401 (re-exported)
    CHANNEL_CLASSES,
    FAULT_CLASSES,
    IN_MEMORY_STRATEGIES,
    NETWORK_CLASSES,
    ChaosConfig,
    Topology,
    parse_topology,
)
from launch.chaos.draw import Trial, describe_fault, draw_trial, fault_classes
from launch.errors import FlagError
from launch.train.fault_plan import Fault

FLAGS = flags.FLAGS

# launch.cli_flags groups (and their flags) that chaos takes: each trial's job
# is a launch.train job of --model and --steps (12 by default), behind the
# links, on the accelerator.
SHARED_FLAGS = {"model": ("model",), "data": ("steps", "workdir"), "links": None,
                "accelerator": None, "output": ("json",)}
CHAOS_DEFAULTS = {"steps": 12}


def define_flags(fv: flags.FlagValues = FLAGS) -> flags.FlagValues:
    """The command's flags, defined when run as a command (or by a test on a
    fresh ``fv``): importing this module for its logic defines none."""
    from launch import cli_flags

    cli_flags.define(fv, SHARED_FLAGS, CHAOS_DEFAULTS)
    flags.adopt_module_key_flags(cli_flags, flag_values=fv)
    flags.DEFINE_integer("trials", 10, "Trials to run.", flag_values=fv)
    flags.DEFINE_integer("only_trial", -1,
                         "Replay this trial index of the seed's draw alone (-1: all trials).",
                         flag_values=fv)
    # Not launch.train's --seed (the job's parameters and data): the seed of
    # the draws (DESIGN.md's contract); the trials' jobs use seed 0.
    flags.DEFINE_integer("seed", 0, "Seed of the trial draws (trial i uses seed * 1000 + i).",
                         flag_values=fv)
    flags.DEFINE_list("topologies", ["2x2", "4x1", "4x1r3"],
                      "Topologies drawn from: HxD (H hosts x D devices, 2 replicas) or HxDrM.",
                      flag_values=fv)
    flags.DEFINE_list("strategies", list(IN_MEMORY_STRATEGIES),
                      "Strategies drawn from (in-memory ones).", flag_values=fv)
    flags.DEFINE_list("faults", [],
                      "Fault classes drawn (empty: all): only trials whose last fault is of "
                      "one of them; classes: " + ", ".join(FAULT_CLASSES) + ".",
                      flag_values=fv)
    flags.DEFINE_float("trial_timeout_s", 900.0, "A trial's job must end within this.",
                       flag_values=fv)
    flags.DEFINE_boolean("keep_going", True, "Run every trial even after a failure.",
                         flag_values=fv)
    flags.DEFINE_boolean("fast_compile", True,
                         "Compile the jobs' steps with LLVM's backend optimizations off and "
                         "share a JAX compilation cache between the jobs (the trials test "
                         "recovery, not speed; the reference runs use the same setting, so "
                         "losses still compare bit for bit).", flag_values=fv)
    return fv


CONSOLE_LOG = "console.log"
"""A failed trial's job console, kept in its WORKDIR."""


def run_trial(trial: Trial, steps: int, model: str, scratch: Path, references: dict,
              timeout_s: float, fast_compile: bool = True, extra: Sequence[str] = ()
              ) -> dict[str, Any]:
    """Runs one trial and checks it; its JSON object. ``extra``: flags every job
    of the trial gets (the reference run's too), e.g. its shaped links."""
    start = time.monotonic()
    result: dict[str, Any] = {
        "trial": trial.index, "seed": trial.seed, "topology": trial.topology.name,
        "strategy": trial.strategy, "persist_every": trial.persist_every,
        "faults": [{**f.to_json(), "class": c}
                   for f, c in zip(trial.faults, fault_classes(trial.faults), strict=True)],
        "stall": None if trial.stall is None else list(trial.stall),
        "variant": list(trial.variant), "max_to_keep": trial.max_to_keep}
    reference = jobs.reference(trial.topology, steps, model, scratch, references, timeout_s,
                               fast_compile, extra)
    work, store = scratch / f"trial{trial.index}", jobs.store_root(scratch)
    flags_ = trial.flags(steps, model)
    result["command"] = "python -m launch.train " + " ".join(
        f"'{f}'" if "[" in f else f for f in [*flags_, *extra])
    try:
        proc, disk = jobs.run_watched(flags_, work, store, timeout_s, fast_compile, extra)
    except subprocess.TimeoutExpired as e:
        said = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        _keep_console(work, said or "")
        tail = " | ".join((said or "").strip().splitlines()[-8:])
        result.update(ok=False, problems=[f"job did not end within {timeout_s:.0f}s; its last "
                                          f"lines: {tail}"],
                      seconds=round(time.monotonic() - start, 1))
        return result
    records = jobs.read_records(work)
    strikes = sum(proc.stdout.count(f"fault: {what}") for what in (
        "SIGKILLed", "paused host", "cut off host", "slowed the link of host"))
    result["persistent_seen"] = sorted({s for snap in disk for s in snap.steps})
    if proc.returncode != 0:
        problems = [f"job exited with {proc.returncode}: " + " | ".join(
            (proc.stdout + proc.stderr).strip().splitlines()[-6:])]
        happened: dict[str, Any] = expected_json(expected(trial, records, disk)[0])
    else:
        problems, happened = check_trial(trial, records, reference, steps, strikes,
                                         committed_steps(work / "checkpoints"), disk)
        if not problems and trial.pec and any(r.get("event") == "recovery" for r in records):
            problems, happened["pec_reference"] = _pec_reference(
                trial, records, flags_, steps, scratch, timeout_s, fast_compile, extra)
    result.update(happened, ok=not problems, problems=problems,
                  seconds=round(time.monotonic() - start, 1))
    if not problems:
        shutil.rmtree(work, ignore_errors=True)
    else:
        _keep_console(work, proc.stdout + proc.stderr)
    return result


def _keep_console(work: Path, text: str) -> None:
    """A failed trial's job console beside its metrics in the kept WORKDIR
    (``console.log``): the post-mortem needs what the hosts said, not only
    what they logged (soak seed 66 trial 16 failed once and kept only its
    metrics; its cause is not known)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / CONSOLE_LOG).write_text(text)


def _pec_reference(trial: Trial, records: list[dict], flags_: list[str], steps: int,
                   scratch: Path, timeout_s: float, fast_compile: bool, extra: Sequence[str]
                   ) -> tuple[list[str], dict[str, Any]]:
    """A PEC trial's reference run, which takes the faulted job's roll-backs
    (``pec_reference``): its problems and the trial's ``pec_reference`` entry."""
    start = time.monotonic()
    plan = pec_reference.rollbacks(records, trial.topology.hosts, trial.topology.replicas,
                                   steps, in_step=trial.commits_next_save)
    entry: dict[str, Any] = {"rollbacks": [f.to_json() for f in plan]}
    work = scratch / f"trial{trial.index}-pec-reference"
    try:
        proc = jobs.run_train(pec_reference.reference_flags(flags_, plan), work,
                              jobs.store_root(scratch), timeout_s, fast_compile, extra)
    except subprocess.TimeoutExpired:
        return ([f"PEC reference: the run did not end within {timeout_s:.0f}s"],
                {**entry, "match": False})
    if proc.returncode != 0:
        return ([f"PEC reference: the run exited with {proc.returncode}: " + " | ".join(
            (proc.stdout + proc.stderr).strip().splitlines()[-6:])], {**entry, "match": False})
    problems, info = pec_reference.compare(records, jobs.read_records(work))
    if not problems:
        shutil.rmtree(work, ignore_errors=True)
    return problems, {**entry, **info, "seconds": round(time.monotonic() - start, 1)}


def _table(results: list[dict]) -> str:
    rows = [("trial", "ok", "topology", "strategy", "persist", "faults", "resumed", "tiers",
             "s")]
    for r in results:
        faults = "; ".join(describe_fault(Fault(
            tuple(f["hosts"]), f["step"], f["point"], f["mode"], f["corrupt"], f["wipe_all"],
            f.get("pause_s", 0.0))) for f in r["faults"])
        rows.append((str(r["trial"]), "ok" if r["ok"] else "FAIL", r["topology"], r["strategy"],
                     str(r["persist_every"]), faults,
                     ",".join(map(str, r.get("resumed_from", []))),
                     ",".join(r.get("tier", [])), f"{r['seconds']:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def main(argv: list[str]) -> int:
    del argv
    try:
        config = ChaosConfig.from_flags(FLAGS)
    except FlagError as e:
        raise app.UsageError(str(e)) from None
    return run(config)


def run(config: ChaosConfig) -> int:
    """The trials of ``config``, their table and summary; the exit code."""
    job_flags = config.job_flags()
    scratch = Path(config.workdir or tempfile.mkdtemp(prefix="capricorn-chaos-"))
    scratch.mkdir(parents=True, exist_ok=True)
    references: dict = {}
    results = []
    started = time.monotonic()
    try:
        indices = [config.only_trial] if config.only_trial >= 0 else range(config.trials)
        for i in indices:
            trial = draw_trial(i, config.seed, list(config.topologies), list(config.strategies),
                               config.steps, shaped=config.link.shaped, classes=config.faults)
            result = run_trial(trial, config.steps, config.model, scratch, references,
                               config.trial_timeout_s, config.fast_compile, job_flags)
            results.append(result)
            status = "ok" if result["ok"] else "FAIL: " + "; ".join(result["problems"])[:300]
            resumed = ",".join(f"{s} ({t})" for s, t in zip(
                result.get("resumed_from", []), result.get("tier", []), strict=True))
            if "pec_reference" in result:
                match = result["pec_reference"]["match"]
                resumed += ", PEC reference " + {True: "matched", False: "did not match",
                                                 None: "not comparable"}[match]
            label = (f"trial index {i} (replayed alone)" if config.only_trial >= 0
                     else f"trial {i + 1}/{config.trials}")
            print(f"{label} (seed {trial.seed}) {trial.describe()} -> "
                  f"resumed {resumed or '-'} in {result['seconds']:.0f}s: {status}", flush=True)
            if config.json:  # after every trial: a soak stopped early keeps what it ran
                _write_json(config.json, results, config.seed, config.steps, config.model)
            if not result["ok"] and not config.keep_going:
                break
    finally:
        if all(r["ok"] for r in results):
            shutil.rmtree(jobs.store_root(scratch), ignore_errors=True)
            if config.workdir is None:
                shutil.rmtree(scratch, ignore_errors=True)
    passed = sum(r["ok"] for r in results)
    print(_table(results))
    print(f"chaos: {passed}/{len(results)} trials passed, {len(results) - passed} failed "
          f"(seed {config.seed}, {time.monotonic() - started:.0f}s)"
          + ("" if passed == len(results) else f"; failed runs kept under {scratch}"))
    if config.json:
        _write_json(config.json, results, config.seed, config.steps, config.model)
    return 0 if passed == len(results) else 1


def _write_json(path: str, results: list[dict], seed: int, steps: int, model: str) -> None:
    passed = sum(r["ok"] for r in results)
    Path(path).write_text(json.dumps(
        {"trials": results, "passed": passed, "failed": len(results) - passed, "seed": seed,
         "steps": steps, "model": model}, indent=1))


def _run() -> None:
    """The command (``python -m launch.chaos``, its ``__main__``)."""
    define_flags()
    app.run(lambda argv: sys.exit(main(argv)))
