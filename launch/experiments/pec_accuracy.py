"""Accuracy of partial expert checkpointing under repeated failures.

    python -m launch.experiments.pec_accuracy --model=small --steps=60 --fail_every=15 \
        --workdir=/tmp/pec_acc --json=/tmp/pec_acc.json

Runs ``launch.train`` once per configuration, same model, data and seed, on
the simulated cluster (default 2 hosts x 2 devices): no failure; full
in-memory checkpoints with host 1 lost every ``--fail_every`` steps; and PEC
with K = 1 and 2 experts per layer (sequential and load-aware, fixed K) under
the same failures. Each failure wipes the lost host's RAM store, so the
restore reads peers' replicas and, under PEC, takes each expert from its
newest saved copy (possibly older than the restore point). Reports per run
the final validation loss (mean over the corpus domains), its change against
the failure-free run, the restores and the accumulated portion of lost
tokens (PLT) of the last restore. Exits non-zero, reporting nothing, when a
run fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from absl import app, flags

from launch.metrics import read_metrics

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined only when run as a command: a test or
    another launcher importing this module for its logic must not define
    flags of the same names twice."""
    flags.DEFINE_string("model", "small", "Model config.")
    flags.DEFINE_integer("steps", 60, "Training steps per run.")
    flags.DEFINE_integer("fail_every", 15, "Host 1 is lost every this many steps (from this step).")
    flags.DEFINE_integer("hosts", 2, "Simulated hosts.")
    flags.DEFINE_integer("devices_per_host", 2, "CPU devices per host.")
    flags.DEFINE_string("dispatch", "fixed", "MoE dispatch of the runs.")
    flags.DEFINE_string("workload", "dynamic", "Data workload.")
    flags.DEFINE_integer("shift_every", 20, "Domain shift period (dynamic workload).")
    flags.DEFINE_list("runs", ["no_failure", "full", "pec1_sequential", "pec2_sequential",
                               "pec1_load_aware", "pec2_load_aware"], "Configurations to run.")
    flags.DEFINE_string("workdir", None, "Directory for the runs.")
    flags.DEFINE_string("json", None, "Write the results here.")
    flags.DEFINE_float("timeout_s", 3600.0, "Deadline of one run.")


def run_flags(name: str) -> list[str]:
    """launch.train flags of configuration ``name``."""
    if name == "no_failure":
        return ["--ckpt=none"]
    fail = [f"--kill_host={FLAGS.hosts - 1}", f"--kill_at_step={FLAGS.fail_every}",
            f"--kill_every={FLAGS.fail_every}", "--kill_mode=host", "--ckpt=inmem"]
    if name == "full":
        return fail
    k, policy = name[3:].split("_", 1)
    return [*fail, f"--pec_k={int(k)}", f"--pec_policy={policy}", "--nopec_dynamic"]


def run_one(name: str, root: Path) -> dict:
    workdir = root / name
    cmd = [sys.executable, "-m", "launch.train", f"--model={FLAGS.model}",
           f"--steps={FLAGS.steps}", f"--hosts={FLAGS.hosts}",
           f"--devices_per_host={FLAGS.devices_per_host}", f"--dispatch={FLAGS.dispatch}",
           f"--workload={FLAGS.workload}", f"--shift_every={FLAGS.shift_every}",
           f"--workdir={workdir}", f"--store_root={root / 'shm'}", "--log_every=20",
           f"--timeout_s={FLAGS.timeout_s}", "--fresh", *run_flags(name)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=FLAGS.timeout_s + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"run {name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                           f"\n{proc.stderr[-2000:]}")
    records = read_metrics(workdir / "metrics.jsonl")
    (evaluation,) = [r for r in records if r.get("event") == "eval"]
    recoveries = [r for r in records if r.get("event") == "recovery"]
    checkpoints = [r for r in records if r.get("event") == "checkpoint"]
    losses = evaluation["val_loss"]
    return {"val_loss": sum(losses.values()) / len(losses), "val_loss_per_domain": losses,
            "restores": len(recoveries),
            "restore_steps": [r["step"] for r in recoveries],
            "plt": recoveries[-1].get("accumulated_plt") if recoveries else None,
            "ckpt_bytes_per_step": checkpoints[-1]["bytes"] if checkpoints else 0}


def main(argv: list[str]) -> None:
    del argv
    root = Path(FLAGS.workdir or "/tmp/capricorn_pec_accuracy")
    root.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in FLAGS.runs:
        print(f"run {name} ...", flush=True)
        try:
            results[name] = run_one(name, root)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
            print(f"pec_accuracy: error: {e}; no results reported", file=sys.stderr)
            sys.exit(1)
        print(f"run {name}: {json.dumps(results[name])}", flush=True)
    base = results.get("no_failure", {}).get("val_loss")
    print("| run | val loss | vs no failure | restores | accumulated PLT | ckpt bytes/step/host |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        delta = f"{100 * (r['val_loss'] / base - 1):+.2f}%" if base else "-"
        plt = "-" if r["plt"] is None else f"{100 * r['plt']:.2f}%"
        print(f"| {name} | {r['val_loss']:.4f} | {delta} | {r['restores']} | {plt} | "
              f"{r['ckpt_bytes_per_step']:,} |")
    if FLAGS.json:
        Path(FLAGS.json).write_text(json.dumps({"runs": results, "flags": {
            "model": FLAGS.model, "steps": FLAGS.steps, "fail_every": FLAGS.fail_every,
            "workload": FLAGS.workload, "hosts": FLAGS.hosts,
            "devices_per_host": FLAGS.devices_per_host}}, indent=1))


if __name__ == "__main__":
    define_flags()
    app.run(main)
