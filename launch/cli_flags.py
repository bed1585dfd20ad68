"""The launchers' command lines: every flag defined once, in groups.

launch.train, launch.bench and launch.chaos take their flags from the groups
here (cluster, links, model, data, training, checkpoint, profiling, faults,
accelerator: the job's, ``GROUPS``), and so do the other commands under launch/
(launch.plan, launch.link_probe, launch.gpu_bench, the experiments), with the
groups of flags that several commands take but a job does not (output,
process); a flag means the same in every command that takes it
(tests/test_launch_flags.py compares every definition of a name). Nothing
is defined on import: ``define(fv, groups)`` defines the chosen groups into a
``FlagValues`` (a command calls it once, before ``app.run``; a test calls it
on a fresh ``FlagValues``), so importing any launch module, or all of them
together, defines no flag and cannot raise ``DuplicateFlagError``.

The command's module adopts them as its key flags (``--help``).
A command may default a flag differently (``defaults``) where its meaning
stays the same (launch.bench wipes its own ``--store_root`` and defaults
``--dispatch=bucketed`` and ``--pec_k=2``, with which its published results
were measured); ``--help`` shows the command's default.
Each command's ``main`` reads the parsed flags once into frozen dataclasses
(``launch.train.config`` for train, ``launch.bench.config``, ``launch.chaos.config``);
nothing past ``main`` reads the namespace (tests/test_launch_flags.py checks it).
Design choice: flag specs as data registered by group, definitions applied
on request. Alternatives not taken: absl definitions at import (broke CI
twice when a test or a second launcher imported two such modules), and
defaults declared on the dataclasses with the flags generated from them
(which would hide each flag's help text behind a table).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from absl import flags

from capricorn_jax import DetectorOptions, ProfilingOptions
from capricorn_jax.experimental import (
    CACHE_GRANULARITIES,
    CAPACITY_CACHE,
    DRIFT_METRICS,
    TRIGGERS,
    CacheOptions,
)
from capricorn_jax.stores import default_store_root
from launch.accelerator import ACCELERATORS
from launch.strategies import STRATEGIES
from models.config import CONFIGS, DISPATCH_MODES
from models.emulation.profile import DEFAULT_PROFILE
from models.emulation.profile import available as available_profiles
from models.routing_bias import VALUES as ROUTING_BIASES

# group -> flag name -> (absl kind, default, help, extra keyword arguments)
_SPECS: dict[str, dict[str, tuple[str, Any, str, dict]]] = {}
_group = "cluster"


def _spec(kind: str, name: str, default: Any, *rest: Any) -> None:
    if kind == "enum":
        enum_values, help_text = rest
        extra: dict = {"enum_values": enum_values}
    else:
        (help_text,), extra = rest, {}
    _SPECS.setdefault(_group, {})[name] = (kind, default, help_text, extra)


def _in(group: str) -> None:
    global _group
    _group = group


_in("cluster")
_spec("integer", "hosts", 2, "Simulated hosts (processes).")
_spec("integer", "devices_per_host", 2, "CPU devices per simulated host.")
_spec("boolean", "pin_hosts", False,
                     "Run each simulated host's process on its own CPUs (this process's CPUs "
                     "split round robin): steadier timings, e.g. for profiling measurements.")
_spec("enum", "platform", "cpu", ["cpu", "gpu"],
                  "cpu: simulated hosts; gpu: this process on the local GPU(s).")
_spec("float", "timeout_s", 3600.0, "Deadline of the whole job; hosts are stopped past it.")
_spec("float", "peer_timeout_s", 100.0,
                   "A host that sends no heartbeat for this long (paused, hung, cut off) ends "
                   "the job, naming it: jax.distributed's heartbeat and shutdown timeouts, "
                   "the bound of every in-graph collective's wait on a silent host.")
_spec("integer", "process_id", -1,
                     "Internal: this worker's host index (set by the supervisor).")
_spec("string", "coordinator", "", "Internal: jax.distributed coordinator address.")

_in("links")
_spec("float", "link_gbps", 0.0,
                   "Run each simulated host in its own network namespace behind a link of this "
                   "many Gbit/s each way (tc tbf; needs root); 0 = unshaped loopback.")
_spec("float", "link_latency_ms", 0.0,
                   "One-way latency between two hosts on the shaped links (netem); needs "
                   "--link_gbps.")
_spec("float", "link_burst_kb", 0.0,
                   "The shaped links' token bucket (tc tbf burst), KB a host may send at "
                   "loopback speed after an idle spell; 0 = one frame (the MTU and the "
                   "Ethernet header), as a real link; needs --link_gbps.")
_spec("integer", "link_mtu", 0,
                     "The shaped links' frame size in bytes (the veths' MTU; 1280..65000); "
                     "0 = the kernel's 1500. Jumbo frames (9000) cut the per-byte kernel work "
                     "the emulated links cost the hosts' cores; needs --link_gbps.")
_spec("boolean", "link_filler", False,
      "Keep the shaped links sending: each host streams to the next in a band below "
      "everything else (and below the checkpoint's class with --traffic_class=priority), "
      "so every frame pays its time on the wire as on a real link (tbf sends a frame that "
      "finds the link idle at once); needs --link_gbps.")
_spec("enum", "traffic_class", "fifo", ["fifo", "priority"],
      "fifo: the shaped links are one first-in-first-out queue (the paper's premise); "
      "priority: the checkpoint's chunk channel sends as a low-priority class (IP TOS 0x08) "
      "and both shapers of each link (what a host sends, what it receives) classify by "
      "that TOS byte into two bands under their tbf, so a "
      "collective waits for at most a frame of checkpoint bytes, and gemini and capricorn "
      "send each version whole at its step's start; needs --link_gbps.")

_in("model")
_spec("string", "model", "tiny", f"Model config: {', '.join(CONFIGS)}.")
_spec("integer", "expert_parallel", 0,
                     "Size of the expert mesh axis; 0 = all devices (capped at num_experts).")
_spec("enum", "dispatch", "", ["", *DISPATCH_MODES],
                  "MoE dispatch: fixed capacity or bucketed (load-dependent); '' = model's.")
_spec("integer", "global_batch", 0, "Sequences per step over all hosts; 0 = model's.")

_in("data")
_spec("integer", "steps", 20,
      "Training steps: of the job (train), of each trial's job (chaos), of one block, one "
      "strategy in one repetition (bench).")
_spec("string", "workdir", None,
      "Directory for metrics.jsonl and checkpoints (train); scratch directory, default a "
      "temporary one (bench, chaos).")
_spec("integer", "seed", 0,
      "Seed of the parameters, dropout, data order and the routing bias's schedule.")
_spec("enum", "workload", "steady", ["steady", "dynamic", "synthetic"],
                  "steady: one domain; dynamic: domain shift every --shift_every steps; "
                  "synthetic: random bytes (explicit opt-in).")
_spec("integer", "shift_every", 50, "Steps between domain shifts (dynamic workload).")

_in("training")
_spec("float", "learning_rate", 3e-3, "Peak AdamW learning rate.")
_spec("integer", "warmup_steps", 10, "Linear warmup steps.")
_spec("integer", "log_every", 10, "Steps between log lines.")
_spec("integer", "eval_sequences", 8, "Validation sequences per domain at the end; 0 = none.")
_spec("boolean", "resume", False,
                     "The default behaviour, accepted for clarity: a WORKDIR that holds "
                     "checkpoints (WORKDIR/checkpoints, the job's RAM stores under --store_root) "
                     "is resumed from, newest version across the tiers; with nothing to resume "
                     "one line says so and the job starts from step 0. Not with --fresh.")
_spec("boolean", "fresh", False,
                     "Start over: delete WORKDIR/metrics.jsonl, WORKDIR/checkpoints and this "
                     "job's RAM stores under --store_root first, printing one line per thing "
                     "deleted (where, how many steps/versions). Without it nothing is deleted.")
_spec("boolean", "verbose", False,
                     "Console: forward every worker line (absl INFO of every host, orbax, gloo "
                     "connection lines, JAX warnings) and the tracebacks of hosts stopped after "
                     "an injected kill. Default: host 0's progress, faults, recoveries, warnings "
                     "of this project, errors and a summary.")

_in("checkpoint")
_spec("enum", "ckpt", "none", list(STRATEGIES),
                  "Checkpoint strategy: none (a restarted job starts over from step 0); "
                  "blocking (every step, every local shard written to this host's RAM disk, "
                  "--store_root, before the next step); orbax_async (plain Orbax async save of "
                  "every step to WORKDIR/checkpoints); orbax_emergency (Orbax's multi-tier "
                  "manager: local tier on the RAM disk every step, persistent every "
                  "--persist_every (0: 10) steps to WORKDIR/checkpoints; its local tier "
                  "needs data-parallel replicas across hosts, --expert_parallel < devices); "
                  "inmem (every step to host RAM + m-1 peers, moved after the step); gemini "
                  "(moved inside the step on a schedule "
                  "from the first --profile_first_n steps' profile, kept); capricorn "
                  "(layer-level schedule, re-partitioned when the expert load drifts); pec / "
                  "capricorn_pec: inmem / capricorn with partial expert checkpoints, which need "
                  "--pec_k (an error without it). Each restores from its own checkpoint.")
_spec("integer", "replicas", 2, "m: copies of each host's checkpoint (own + m-1 peers).")
_spec("integer", "chunk_bytes", 4 << 20, "Transfer chunk size of the in-memory tier.")
_spec("integer", "chunk_cap_bytes", 0,
                     "--ckpt=gemini|capricorn: the largest chunk the schedule places in a window "
                     "(the partitioner's cap); 0 = --chunk_bytes.")
_spec("enum", "chunk_path", "auto", ["auto", "in_graph", "threaded"],
                  "--ckpt=gemini|capricorn: how a window's chunks move: collective-permutes "
                  "inside the jitted step (in_graph), or a sender thread outside it started "
                  "by boundary marks (threaded); auto: in_graph on GPU, threaded otherwise. "
                  "--ckpt=inmem|pec replicate over the same chunk channel with threaded (the "
                  "whole version as soon as it is packed, committed one save later), in the "
                  "in-graph exchange otherwise; launch.bench resolves auto to threaded for "
                  "every in-memory row on CPU with --replicas=2 (one transport per comparison).")
_spec("string", "store_root", default_store_root(),
                    "Base directory of the host RAM stores (tmpfs).")
_spec("float", "ckpt_budget", -1.0,
                   "The in-memory tier's cost budget: the longest (seconds) a step waits for "
                   "the tier's writers. When a host's writers are still busy with the previous "
                   "version, every host skips the next one (never a half version) and the "
                   "checkpoint events report the interval achieved. -1: no budget, a version "
                   "every step (a save waits for the previous one).")
_spec("float", "replication_timeout_s", 30.0,
                   "A version not confirmed by every replica after this is under-replicated.")
_spec("float", "persist_timeout_s", 300.0,
      "The persistent tier's bound: reading a version from host RAM, then writing it, each at "
      "most twice this; a step some host did not write within it is dropped on every host "
      "(Orbax's barrier timeout is 4x this).")
_spec("integer", "persist_every", 0,
      "Steps between the strategy's persistent writes to WORKDIR/checkpoints: the in-memory "
      "strategies' persistent tier (the in-memory version written as a standard Orbax step, in "
      "the background, from host RAM; 0: no persistent tier), and orbax_emergency's persistent "
      "tier (0: every 10 steps; its local tier saves every step).")
_spec("integer", "max_to_keep", 3, "Persistent steps kept in WORKDIR/checkpoints.")
_spec("integer", "pec_k", 0,
                     "Partial expert checkpointing (in-memory strategies): experts per MoE "
                     "layer in each version (0: all, no PEC; --ckpt=pec and capricorn_pec "
                     "need a value > 0).")
_spec("enum", "pec_policy", "sequential", ["sequential", "load_aware"],
                  "PEC: which experts a version carries.")
_spec("float", "pec_plt_threshold", 0.0375,
                   "PEC: dynamic K doubles K when the portion of lost tokens would pass this.")
_spec("boolean", "pec_dynamic", True, "PEC: adapt K to the portion of lost tokens.")
_spec("integer", "pec_k_persist", 0,
                     "PEC with --persist_every: experts per MoE layer in each persistent step "
                     "(<= --pec_k, a multiple of the expert-parallel size; each step carries the "
                     "least recently persisted experts); 0: all experts (full steps).")

_spec("integer", "max_version_lag", 50,
      "In-memory strategies: the lag alarm's bound, in steps (the safe version normally "
      "trails training by 2 or 3 saves). The newest safe version's age "
      "(steps and seconds since the state it holds) is in every step's metrics record and on "
      "the console when it reaches 8, 16, 32, ... steps; past this many steps the job says "
      "why versions stopped committing (slow link, corrupt frames, lost channel, busy "
      "writers: the `lag` event and a warning) and acts as --on_lag says. 0: no bound.")
_spec("enum", "on_lag", "warn", ["warn", "fail"],
      "What a lag past --max_version_lag does: warn (the job goes on) or fail (the job ends "
      "with that error, exit code 4).")

_in("profiling")
_spec("string", "profile", "",
                    "Layer profiling: off | every | first_n (the first --profile_first_n steps "
                    "once, Gemini) | speculative (when the dynamicity detector asks, Capricorn); "
                    "'' = the --ckpt strategy's policy (off for none and inmem).")
_spec("boolean", "timeline", False,
                     "Write WORKDIR/timeline.json (Chrome/Perfetto trace) and timeline.png: host "
                     "0's last profiled iteration (layers, all-to-alls) with the checkpoint chunks "
                     "of the schedule in force in it (gemini/capricorn), overflowing windows red. "
                     "Needs a profiling policy.")
_spec("integer", "profile_first_n", ProfilingOptions().first_n,
      "--profile=first_n: the steps profiled at the start.")
_spec("enum", "profile_trigger", ProfilingOptions().trigger, list(TRIGGERS),
                  "--profile=speculative: what asks for a profile. capacity: the next step's "
                  "capacity tuple (known before it runs) has fewer than "
                  "--profile_cache_samples warm profiles younger than --profile_cache_max_age "
                  "(a layer's time follows its capacity, not the rest of the load); drift: the "
                  "expert load drifted past --drift_threshold since the last profile.")
_spec("float", "drift_threshold", DetectorOptions().threshold,
                   "--profile_trigger=drift: a layer's drift score of the expert load (since the "
                   "last profile) above which the next step is profiled.")
_spec("enum", "drift_metric", DetectorOptions().metric, list(DRIFT_METRICS),
                  "--profile_trigger=drift: the drift score "
                  "(capricorn_jax.DetectorOptions.metric).")
_spec("integer", "profile_cache_max_age", 0,
                     "--profile=speculative: a capacity tuple's profile stands for it, when the "
                     "load flips back to it, for up to this many steps. Capacity trigger: 0 = "
                     f"{CAPACITY_CACHE.max_age}. Drift trigger with --dispatch=bucketed: a "
                     "profile only when the detector drifts or the tuple changes and the tuple "
                     "has no cached profile that young; 0 = no cache (every drift profiles); "
                     "fixed dispatch: ignored.")
_spec("integer", "profile_cache_samples", 0,
                     "Capacity trigger, or --profile_cache_max_age > 0: warm profiles of a "
                     "capacity tuple (each younger than the max age) the cache needs before it "
                     "answers for the tuple; it answers with their per-segment median (steadier "
                     f"than one profile). 0 = the trigger's default: capacity "
                     f"{CAPACITY_CACHE.samples}, drift {CacheOptions().samples}.")
_spec("enum", "profile_cache_granularity", "tuple", list(CACHE_GRANULARITIES),
                  "--profile_cache_max_age > 0: file a profile under its whole capacity tuple, "
                  "or under each MoE layer's capacity factor (a layer's segments are then "
                  "answered from any profile in which it ran at that factor).")

_in("faults")
_spec("integer", "kill_host", -1, "Fault injection: SIGKILL this host's process...")
_spec("integer", "kill_at_step", -1, "...when host 0 has finished this step...")
_spec("integer", "kill_every", 0,
                     "Fault injection: kill --kill_host again every this many steps after "
                     "--kill_at_step (0: once); each time all hosts restart and recover.")
_spec("enum", "kill_mode", "process", ["process", "host"],
                  "...process: its RAM store survives; host: its store is wiped (machine loss).")
_spec("enum", "kill_point", "after_step",
                  ["after_step", "mid_step", "mid_replication", "mid_persist", "recovery"],
                  "after_step: when the step is logged; mid_step: while the step runs; "
                  "mid_replication: while the host is halfway through writing the replicas "
                  "it received for that step; mid_persist: while the persistent tier writes "
                  "the version after that step; recovery: while the job recovers (the "
                  "attempt after a kill).")
_spec("boolean", "corrupt_store", False,
                     "Fault injection: after the kill, flip bytes in a chunk of the killed host's "
                     "own newest version (RAM bit rot); it must then recover from a peer.")
_spec("string", "fault_plan", "",
                    "Fault injection, several faults: a JSON list (or @PATH of one) of "
                    "{\"hosts\": [..], \"step\", \"point\" (as --kill_point), \"mode\" "
                    "(process|host), \"corrupt\", \"wipe_all\" (every RAM store lost)}; "
                    "each fault ends one attempt, all hosts restart and recover. The last "
                    "fault may instead be \"point\": \"persist_error\" or "
                    "\"persist_hang\": the hosts' persistent write of the version after "
                    "\"step\" fails with an I/O error, or hangs, there (no kill; that step "
                    "is dropped on every host); or \"point\": \"pause\" with \"pause_s\": "
                    "the hosts are stopped (SIGSTOP) after \"step\" for that long, then go "
                    "on (past --peer_timeout_s the job ends, restarts and recovers). Not with "
                    "--kill_host.")
_spec("integer", "stall_host", -1, "Fault injection: this host's replica writer stalls...")
_spec("integer", "stall_at_step", -1, "...at this step...")
_spec("float", "stall_seconds", 0.0, "...for this long (a peer that stops answering).")
_spec("string", "fault_at", "", "Internal: set by the supervisor (POINT:STEP).")

_in("accelerator")
_spec("enum", "accelerator", "none", list(ACCELERATORS),
      "none: the model computes on the simulated devices; emulated: each layer's compute is "
      "a wait of the accelerator profile's duration.")
_spec("string", "accelerator_profile", "",
      f"The emulated accelerator's profile (--accelerator=emulated): a shipped profile "
      f"({', '.join(available_profiles())}; default {DEFAULT_PROFILE}) or a profile JSON "
      "file.")
# In this group because its default follows --accelerator, and every command takes the group.
_spec("enum", "routing_bias", "auto", list(ROUTING_BIASES),
      "Bias the router of training steps to a published schedule of expert loads "
      "(models.routing_bias): one hot expert per MoE layer that changes with the dynamic "
      "workload's domain, its load over the mean fluctuating early, stable later. auto: "
      "cong24 under --accelerator=emulated --workload=dynamic, none otherwise; a named "
      "schedule needs --workload=dynamic.")

GROUPS = tuple(_SPECS)
"""The job's groups: launch.train takes every flag of them, the other commands
some. The groups below are not a job's (launch.train takes none of them)."""

_in("output")
_spec("string", "json", None, "Write the results here as JSON.")
_spec("string", "png", None,
      "Write the plot here (PNG): launch.bench a bar chart of the median step times (error "
      "bars); launch.experiments.emulated_sweep plot each strategy's step over none's "
      "against R.")
_spec("string", "out", None,
      "Output folder: launch.gpu_bench's summary.json and its parts' logs; "
      "launch.experiments.emulated_sweep run's point JSONs.")

_in("process")
_spec("integer", "devices", 4,
      "CPU devices of this command's one process (XLA's forced host platform device count).")


def define(fv: flags.FlagValues, groups: Mapping[str, Iterable[str] | None],
           defaults: Mapping[str, Any] | None = None) -> None:
    """Defines the flags of ``groups`` into ``fv``.

    Args:
      fv: the namespace (``flags.FLAGS`` for a command, a fresh one in tests).
      groups: group name -> the flag names of it the command takes (None: all).
      defaults: a command's own defaults, flag name -> value (same meaning).

    Raises:
      KeyError: an unknown group or flag name; absl's DuplicateFlagError when
        ``fv`` already holds one of the flags.
    """
    defaults = dict(defaults or {})
    for group, names in groups.items():
        specs = _SPECS[group]
        for name in (specs if names is None else names):
            kind, default, help_text, extra = specs[name]
            default = defaults.pop(name, default)
            definer = getattr(flags, f"DEFINE_{kind}")
            definer(name, default, help=help_text, flag_values=fv, **extra)
    if defaults:
        raise KeyError(f"defaults for flags not defined: {sorted(defaults)}")
