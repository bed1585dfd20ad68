"""The launchers' flags: defined once (launch.cli_flags), only when asked.

Every command defines its flags into a FlagValues it is given and parses
them; importing every launch module together defines no flag (absl flags
defined at import broke CI twice, when a test imported two such modules).
A flag name means one thing: every command that defines it defines it alike
(type, help, enum values, default), but for the defaults a command declares
and the flags declared its own (``OWN``).
"""

import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Collection, Mapping
from typing import Any

import pytest
from absl import flags

from capricorn_jax import stores
from launch import accelerator, cli_flags, errors, gpu_bench, link_probe, plan, plot_timeline
from launch.bench import command as bench
from launch.bench import config as bench_config
from launch.chaos import command as chaos
from launch.chaos import config as chaos_config
from launch.experiments import (
    bandwidth,
    emulated_sweep,
    frame_mac_cost,
    fsync_cost,
    plot_profile,
    routing_bias,
)
from launch.train import command as train
from launch.train import config
from tests.helpers import ROOT

# Every module that defines absl flags (a command; tests/test_launch_flags.py
# finds any other: test_every_module_defining_flags_is_compared).
COMMANDS = {"train": train, "bench": bench, "chaos": chaos, "stores": stores,
            "link_probe": link_probe, "plan": plan, "gpu_bench": gpu_bench,
            "plot_timeline": plot_timeline, "emulated_sweep": emulated_sweep,
            "routing_bias": routing_bias, "bandwidth": bandwidth, "fsync_cost": fsync_cost,
            "frame_mac_cost": frame_mac_cost, "plot_profile": plot_profile}
# Each command's own defaults of flags it shares (same meaning, another default).
DECLARED = {"bench": bench.BENCH_DEFAULTS, "chaos": chaos.CHAOS_DEFAULTS,
            "plan": plan.PLAN_DEFAULTS, "link_probe": link_probe.LINK_PROBE_DEFAULTS,
            "gpu_bench": gpu_bench.GPU_BENCH_DEFAULTS,
            "emulated_sweep": emulated_sweep.SWEEP_DEFAULTS,
            "routing_bias": routing_bias.ROUTING_BIAS_DEFAULTS,
            "fsync_cost": fsync_cost.FSYNC_COST_DEFAULTS}
# A command's own flag under a name another command defines too, with another
# meaning (documented usage, so not renamed): flag name -> those commands.
_OWN = {
    # chaos's --seed seeds the trial draws (its DESIGN.md contract), not the job.
    "seed": ("chaos",),
    # Which strategies: chaos draws trials from in-memory ones, the planner
    # simulates its own set; the bench's (and the sweep's, passed on) run side by side.
    "strategies": ("chaos", "plan"),
    # Topologies: chaos's HxD or HxDrM drawn from, the sweep's HxD grid.
    "topologies": ("chaos", "emulated_sweep"),
    # The planner's trace (steady | dynamic | a metrics.jsonl), the timeline's JSON.
    "trace": ("plan", "plot_timeline"),
    # The PNG file the plot commands write (cli_flags' --out is an output folder).
    "out": ("plot_timeline", "plot_profile"),
    # Each measurement's own size and repetitions.
    "mib": ("link_probe", "bandwidth", "fsync_cost", "frame_mac_cost"),
    "repeats": ("link_probe", "bandwidth", "frame_mac_cost"),
}
OWN = {(command, name) for name, commands in _OWN.items() for command in commands}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_defines_and_parses_its_flags(name, tmp_path):
    fv = COMMANDS[name].define_flags(flags.FlagValues())
    fv([name, f"--workdir={tmp_path}"] if "workdir" in fv else [name])
    assert fv.is_parsed()
    shared = {f for f in fv if any(f in s for s in cli_flags._SPECS.values())}
    for flag in shared - {f for n, f in OWN if n == name}:  # the cli_flags one, same help
        spec = next(s[flag] for s in cli_flags._SPECS.values() if flag in s)
        assert fv[flag].help.endswith(spec[2]), flag


def test_train_flags_build_the_config_with_the_accelerator_group(tmp_path):
    fv = train.define_flags(flags.FlagValues())
    fv(["train", f"--workdir={tmp_path}"])
    want = accelerator.AcceleratorConfig(accelerator="none", profile="")
    assert config.from_flags(fv).accelerator == want
    fv = train.define_flags(flags.FlagValues())
    fv(["train", f"--workdir={tmp_path}", "--accelerator=emulated",
        "--accelerator_profile=h200_gpt_moe_125m_8e"])
    want = accelerator.AcceleratorConfig(accelerator="emulated", profile="h200_gpt_moe_125m_8e")
    assert config.from_flags(fv).accelerator == want
    fv = train.define_flags(flags.FlagValues())
    fv(["train", f"--workdir={tmp_path}", "--accelerator=emulated", "--accelerator_profile=h100"])
    with pytest.raises(config.FlagError, match="accelerator profile 'h100' is neither a file"):
        config.from_flags(fv)
    fv = train.define_flags(flags.FlagValues())
    fv(["train", f"--workdir={tmp_path}", "--accelerator_profile=h100"])
    with pytest.raises(config.FlagError,
                       match="--accelerator_profile='h100' needs --accelerator=emulated"):
        config.from_flags(fv)


def test_train_flags_carry_the_busy_link_to_the_cluster(tmp_path):
    fv = train.define_flags(flags.FlagValues())
    fv(["train", f"--workdir={tmp_path}", "--link_gbps=0.2", "--traffic_class=priority",
        "--link_filler"])
    link = config.from_flags(fv).cluster.link
    assert link.filler and link.record()["filler"] is True
    fv = train.define_flags(flags.FlagValues())
    fv(["train", f"--workdir={tmp_path}", "--link_filler"])
    with pytest.raises(config.FlagError, match="--link_filler needs --link_gbps > 0"):
        config.from_flags(fv)


BENCH_RECORDED = ("model", "workload", "shift_every", "steps", "reps", "hosts",
                  "devices_per_host", "dispatch", "replicas", "global_batch", "platform",
                  "a2a_steps", "collectives", "ckpt_budget", "accelerator", "accelerator_profile")


def _bench(tmp_path, *argv):
    fv = bench.define_flags(flags.FlagValues())
    fv(["bench", f"--workdir={tmp_path}", *argv])
    return fv, bench_config.BenchConfig.from_flags(fv)


def test_bench_config_holds_the_flags_and_records_them_as_the_json_did(tmp_path):
    fv, cfg = _bench(tmp_path, "--strategies=none,pec,gemini_in_graph", "--global_batch=8",
                     "--accelerator=emulated", "--link_gbps=0.5", "--reps=2")
    # The JSON's "config": the same keys and values the command read from the flags,
    # and the routing bias resolved (auto: none on the steady workload).
    record = cfg.record()
    assert record.pop("routing_bias") == "none"
    assert record == {k: fv[k].value for k in BENCH_RECORDED}
    assert list(record) == list(BENCH_RECORDED)
    assert cfg.strategies == ("none", "pec", "gemini_in_graph") and cfg.pec_k == 2
    assert cfg.chunk_path_of("gemini_in_graph") == "in_graph"
    # auto: the channel for every in-memory row on CPU with 2 replicas (one transport).
    assert cfg.chunk_path_of("pec") == "threaded"
    assert cfg.transport_of("pec") == "threaded" and cfg.transport_of("none") is None
    assert cfg.transport_of("gemini_in_graph") == "in_graph"
    assert cfg.setup.overrides() == {"dispatch": "bucketed", "global_batch": 8}
    assert cfg.setup.link.record()["requested_gbps"] == 0.5
    # No --a2a_steps (every step is probed): the last repetition's untimed step.
    assert cfg.total_steps() == (3 + 10 * 2 + 1) * 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.reps = 3


@pytest.mark.parametrize("argv, message", [
    (["--strategies=none,foo"], "--strategies: unknown ['foo']; known: none, blocking"),
    (["--strategies=pec", "--pec_k=0"], "--pec_k=0: the pec rows checkpoint K experts"),
    (["--accelerator_profile=h100"], "--accelerator_profile='h100' needs --accelerator=emulated"),
    (["--link_latency_ms=2"], "--link_latency_ms needs --link_gbps > 0"),
    (["--link_burst_kb=20"], "--link_burst_kb needs --link_gbps > 0"),
    (["--link_mtu=9000"], "--link_mtu needs --link_gbps > 0"),
    (["--link_filler"], "--link_filler needs --link_gbps > 0"),
    (["--link_gbps=1", "--platform=gpu"], "--link_gbps shapes the simulated CPU hosts' links"),
])
def test_bench_config_names_a_bad_flag(tmp_path, argv, message):
    with pytest.raises(errors.FlagError, match=re.escape(message)):
        _bench(tmp_path, *argv)


def _chaos(*argv):
    fv = chaos.define_flags(flags.FlagValues())
    fv(["chaos", *argv])
    return chaos_config.ChaosConfig.from_flags(fv)


def test_chaos_config_holds_the_flags_and_the_jobs_flags():
    cfg = _chaos("--topologies=2x2,4x1r3", "--accelerator=emulated", "--trials=3")
    assert [t.name for t in cfg.topologies] == ["2x2", "4x1r3"]
    assert cfg.topologies[1] == chaos.Topology("4x1r3", 4, 1, 3)  # re-exported by chaos
    assert (cfg.trials, cfg.steps, cfg.seed, cfg.model) == (3, 12, 0, "tiny")
    assert cfg.strategies == ("inmem", "gemini", "capricorn", "pec")
    assert cfg.job_flags() == ["--accelerator=emulated"]
    assert _chaos().job_flags() == [] and _chaos().faults == ()
    assert _chaos("--faults=stall_channel,double_kill").faults == ("stall_channel",
                                                                   "double_kill")
    shaped = _chaos("--link_gbps=0.2", "--link_burst_kb=20")
    assert shaped.job_flags() == ["--link_gbps=0.2", "--link_latency_ms=0", "--link_burst_kb=20",
                                  "--traffic_class=fifo"]
    assert _chaos("--link_gbps=0.2", "--traffic_class=priority").job_flags()[-1] == \
        "--traffic_class=priority"
    assert _chaos("--link_gbps=0.2", "--link_burst_kb=20", "--link_mtu=9000").job_flags()[-1] \
        == "--link_mtu=9000"
    busy = _chaos("--link_gbps=0.2", "--link_filler")
    assert busy.link.filler and busy.job_flags()[-1] == "--link_filler"
    assert "--link_filler" not in _chaos("--link_gbps=0.2").job_flags()


@pytest.mark.parametrize("argv, error, message", [
    (["--topologies=2y2"], ValueError, "--topologies: '2y2' is not HxD or HxDrM"),
    (["--trials=0"], errors.FlagError, "--trials must be >= 1 and --steps >= 6, got 0, 12"),
    (["--strategies=inmem,blocking"], errors.FlagError, "--strategies: ['blocking'] are not"),
    (["--strategies=gemini", "--topologies=4x1r3"], errors.FlagError,
     "--topologies=4x1r3: none of --strategies=gemini runs there"),
    (["--link_latency_ms=2"], errors.FlagError, "--link_latency_ms needs --link_gbps > 0"),
    (["--faults=pause,bitrot"], errors.FlagError, "--faults: ['bitrot'] are not fault "
                                                      "classes (after_step, mid_step"),
    (["--faults=partition"], errors.FlagError, "--faults: ['partition'] act on shaped "
                                                   "links: they need --link_gbps > 0"),
    (["--faults=stall_channel", "--strategies=gemini", "--topologies=2x2"], errors.FlagError,
     "--faults: ['stall_channel'] are drawn for capricorn, and inmem and pec over the chunk "
     "channel: add one of them to --strategies"),
])
def test_chaos_config_names_a_bad_flag(argv, error, message):
    with pytest.raises(error, match=re.escape(message)) as info:
        _chaos(*argv)
    # A topology that does not parse stays a ValueError (the command never made
    # it a usage error); the others are FlagErrors, main's usage errors.
    assert (info.type is errors.FlagError) == (error is errors.FlagError)


def test_inmem_on_the_chunk_channel_needs_two_replicas(tmp_path):
    """--chunk_path=threaded puts inmem/pec on the chunk channel (one peer
    replica); with --replicas=3 the flags are refused by name, and with 2 the
    config carries the path to the strategy factory."""
    base = ["train", f"--workdir={tmp_path}", "--hosts=4", "--ckpt=inmem",
            "--chunk_path=threaded"]
    fv = train.define_flags(flags.FlagValues())
    fv([*base, "--replicas=3"])
    with pytest.raises(config.FlagError, match=r"^--replicas=3: --chunk_path=threaded sends one "):
        config.from_flags(fv)
    fv = train.define_flags(flags.FlagValues())
    fv([*base, "--replicas=2"])
    assert config.from_flags(fv).checkpoint.chunk_path == "threaded"


def _definition(flag: flags.Flag) -> dict[str, Any]:
    """What the comparison compares of a flag's definition."""
    return {"type": (type(flag).__name__, type(flag.parser).__name__,
                     type(flag.serializer).__name__),
            "enum values": getattr(flag.parser, "enum_values", None),
            "help": flag.help, "default": flag.default}


def definition_conflicts(commands: Mapping[str, flags.FlagValues],
                         declared: Mapping[str, Mapping[str, Any]] | None = None,
                         own: Collection[tuple[str, str]] = ()) -> list[str]:
    """Where commands define a flag name differently: for every name that two
    or more of ``commands`` (name -> its FlagValues) define, leaving out the
    (command, name) pairs of ``own``, each aspect (the flag's type: its absl
    flag, parser and serializer classes; its enum values; its help; its
    default) that differs, as '<name>: <aspect>: <command> <value> !=
    <command> <value>'. A default in ``declared[command]`` (the command's own
    defaults) is left out of the comparison but must be the flag's default
    ('<name>: <command> declares ...'), and must be of a flag it defines."""
    declared = declared or {}
    found = []
    by_name: dict[str, dict[str, dict[str, Any]]] = {}
    for command, fv in commands.items():
        for name, value in declared.get(command, {}).items():
            if name not in fv:
                found.append(f"{name}: {command} declares a default of a flag it does not "
                             f"define")
            elif fv[name].default != value:
                found.append(f"{name}: {command} declares the default {value!r}, its flag's "
                             f"is {fv[name].default!r}")
        for name in fv:
            if (command, name) not in own:
                by_name.setdefault(name, {})[command] = _definition(fv[name])
    for name, definitions in sorted(by_name.items()):
        for aspect in ("type", "enum values", "help", "default"):
            seen = [(command, d[aspect]) for command, d in definitions.items()
                    if aspect != "default" or name not in declared.get(command, {})]
            found += [f"{name}: {aspect}: {seen[0][0]} {seen[0][1]!r} != {command} {value!r}"
                      for command, value in seen[1:] if value != seen[0][1]]
    return found


def _all_commands_flags() -> dict[str, flags.FlagValues]:
    """Every command's flags, and every cli_flags group's (as "cli_flags")."""
    out = {name: module.define_flags(flags.FlagValues()) for name, module in COMMANDS.items()}
    out["cli_flags"] = flags.FlagValues()
    cli_flags.define(out["cli_flags"], {group: None for group in cli_flags._SPECS})
    return out


def test_a_flag_name_is_defined_alike_by_every_command():
    """Every flag two or more commands (or a command and launch.cli_flags)
    define is defined alike: same type, enum values, help and default, but for
    each command's declared defaults and the declared own flags."""
    assert definition_conflicts(_all_commands_flags(), DECLARED, OWN) == []


def test_the_declared_own_flags_are_current():
    """An own flag is a flag of its command whose name another command (or
    launch.cli_flags) defines too: a stale exception is dropped."""
    commands = _all_commands_flags()
    for command, name in OWN:
        assert name in commands[command], (command, name)
        assert any(name in fv for other, fv in commands.items() if other != command), name


def test_every_module_defining_flags_is_compared():
    """A module under launch/ (or the library) that defines absl flags is a
    command in COMMANDS, so its definitions are compared."""
    defining = set()
    for folder in ("launch", "models", "capricorn_jax"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if re.search(r"\bflags\.DEFINE_|cli_flags\.define\(", path.read_text()):
                defining.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    defining -= {"launch.cli_flags"}  # the specs, defined by the commands
    assert defining == {module.__name__ for module in COMMANDS.values()}


def test_the_comparison_reports_a_flag_defined_twice_differently():
    shared = flags.FlagValues()
    cli_flags.define(shared, {"data": ("steps",)})
    help_text = shared["steps"].help

    def planted(definer, default=20, help=help_text, **extra):
        fv = flags.FlagValues()
        definer("steps", default, help, flag_values=fv, **extra)
        return fv

    assert definition_conflicts({"a": shared, "b": planted(flags.DEFINE_integer)}) == []
    assert definition_conflicts({"a": shared, "b": planted(flags.DEFINE_integer,
                                                           help="Steps.")}) == [
        f"steps: help: a {help_text!r} != b 'Steps.'"]
    assert definition_conflicts({"a": shared, "b": planted(flags.DEFINE_float)}) == [
        "steps: type: a ('Flag', 'IntegerParser', 'ArgumentSerializer') != "
        "b ('Flag', 'FloatParser', 'ArgumentSerializer')"]
    eight = planted(flags.DEFINE_integer, default=8)
    assert definition_conflicts({"a": shared, "b": eight}) == [
        "steps: default: a 20 != b 8"]
    assert definition_conflicts({"a": shared, "b": eight}, {"b": {"steps": 8}}) == []
    assert definition_conflicts({"a": shared, "b": eight}, {"b": {"steps": 9}}) == [
        "steps: b declares the default 9, its flag's is 8"]
    assert definition_conflicts({"a": shared, "b": planted(flags.DEFINE_float, help="Other.")},
                                own={("b", "steps")}) == []
    first, second = flags.FlagValues(), flags.FlagValues()
    flags.DEFINE_enum("mode", "x", ["x", "y"], "Mode.", flag_values=first)
    flags.DEFINE_enum("mode", "x", ["x", "z"], "Mode.", flag_values=second)
    assert definition_conflicts({"a": first, "b": second}) == [
        "mode: enum values: a ['x', 'y'] != b ['x', 'z']",
        "mode: help: a '<x|y>: Mode.' != b '<x|z>: Mode.'"]


def test_a_flag_defined_twice_or_unknown_is_an_error():
    fv = flags.FlagValues()
    cli_flags.define(fv, {"links": None})
    with pytest.raises(flags.DuplicateFlagError):
        cli_flags.define(fv, {"links": ("link_gbps",)})
    with pytest.raises(KeyError, match="no_such_flag"):
        cli_flags.define(flags.FlagValues(), {"links": None}, {"no_such_flag": 1})


_IMPORT_ALL = """
import importlib, json, pkgutil
from absl import app, flags, logging  # absl's own flags (logging, app) come with it
import launch
before = sorted(flags.FLAGS)
names = sorted(m.name for m in pkgutil.walk_packages(launch.__path__, "launch.")
               if not m.name.endswith("__main__"))  # a command's __main__ runs it
for name in names:
    importlib.import_module(name)
added = set(flags.FLAGS) - set(before)  # libraries' own flags (orbax) aside:
ours = sorted(f for f in added if (flags.FLAGS.find_module_defining_flag(f) or "").startswith(
    ("launch", "models", "capricorn_jax", "__main__")))
print(json.dumps({"modules": names, "added": ours}))
"""


def test_importing_every_launch_module_together_defines_no_flag():
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert {"launch.train.command", "launch.bench.command", "launch.chaos.command",
            "launch.cli_flags"} <= set(out["modules"])
    assert out["added"] == []


# Library code that sets a flag Orbax defines (its distributed-barrier switch,
# ``persistent.barriers``) for programs that never parse absl flags: Orbax's
# setting, not a command's configuration.
ORBAX_FLAG_SETTERS = {"capricorn_jax/_src/persistent/barriers.py"}


def flag_reads_outside_main(source: str) -> list[str]:
    """Where a module reads the absl flag namespace (``FLAGS`` or
    ``flags.FLAGS``) other than in a function named ``main``: '<function>:<line>'
    ('<module>' at top level). Allowed without a finding: the module-level
    ``FLAGS = flags.FLAGS``, the namespace as ``define_flags``' default, and
    the ``if __name__ == "__main__":`` block."""
    import ast

    tree = ast.parse(source)
    allowed: set[int] = set()  # ids of nodes where a read is fine
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "FLAGS"):
            allowed |= {id(n) for n in ast.walk(node.value)}
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            allowed |= {id(n) for n in ast.walk(node)}
    out = []

    def visit(node, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name == "define_flags":
                allowed.update(id(n) for d in node.args.defaults for n in ast.walk(d))
            if node.name == "main":
                return  # a command's main reads its flags
            where = node.name
        is_read = ((isinstance(node, ast.Name) and node.id == "FLAGS"
                    and isinstance(node.ctx, ast.Load))
                   or (isinstance(node, ast.Attribute) and node.attr == "FLAGS"
                       and isinstance(node.value, ast.Name) and node.value.id == "flags"))
        if is_read and id(node) not in allowed:
            out.append(f"{where}:{node.lineno}")
            return
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(tree, "<module>")
    return out


def test_only_a_commands_main_reads_the_flags():
    """Everything past a command's main gets frozen config objects (launch.train.config,
    launch.bench.config, launch.chaos.config), never the flag namespace."""
    found = {}
    for folder in ("launch", "models", "capricorn_jax"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            reads = flag_reads_outside_main(path.read_text())
            if reads and rel not in ORBAX_FLAG_SETTERS:
                found[rel] = reads
    assert found == {}
    for rel in ORBAX_FLAG_SETTERS:  # a stale exception is dropped
        assert flag_reads_outside_main((ROOT / rel).read_text()), rel


def test_the_flag_read_check_finds_a_helper_reading_flags():
    source = '''
from absl import flags
FLAGS = flags.FLAGS


def define_flags(fv=FLAGS):
    return fv


def helper():
    return FLAGS.steps + flags.FLAGS.hosts


def main(argv):
    return helper() + FLAGS.steps


if __name__ == "__main__":
    main(FLAGS)
'''
    assert flag_reads_outside_main(source) == ["helper:11", "helper:11"]


def test_the_persistent_timeout_must_stay_below_the_agreement_bound(tmp_path):
    from capricorn_jax._src.multihost import agree
    from launch.train import command as train
    from launch.train import config

    assert config.AGREEMENT_TIMEOUT_S == agree.DEFAULT_TIMEOUT_S
    fv = train.define_flags(flags.FlagValues())
    fv(["train", f"--workdir={tmp_path}", "--ckpt=inmem", "--persist_timeout_s=450"])
    with pytest.raises(config.FlagError, match=r"--persist_timeout_s=450: the persistent tier's "
                                               r"barriers wait up to 4x it \(1800 s\), which "
                                               r"must be positive and below the cross-host "
                                               r"agreement bound \(1800 s\)"):
        config.from_flags(fv)
    fv = train.define_flags(flags.FlagValues())
    fv(["train", f"--workdir={tmp_path}", "--ckpt=inmem", "--persist_timeout_s=449"])
    assert config.from_flags(fv).checkpoint.persist_timeout_s == 449


def test_workers_bound_orbaxs_synchronous_barriers():
    """A worker's Orbax runs its synchronous barriers on the distributed client
    (bounded) rather than as collectives (``runtime.bound_orbax_barriers``)."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    code = ("import sys; from absl import flags; flags.FLAGS(sys.argv[:1]); "
            "from launch.runtime import bound_orbax_barriers, ORBAX_BARRIER_S; "
            "from orbax.checkpoint._src.multihost import multihost as m; "
            "before = m.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.value; "
            "bound_orbax_barriers(flags.FLAGS); "
            "print(before, m.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.value, "
            "m.coordination_timeout() == ORBAX_BARRIER_S)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "True"]
