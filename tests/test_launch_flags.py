"""The launchers' flags: defined once (launch.cli_flags), only when asked.

Every command defines its flags into a FlagValues it is given and parses
them; importing every launch module together defines no flag (absl flags
defined at import broke CI twice, when a test imported two such modules).
"""

import json
import subprocess
import sys

import pytest
from absl import flags

from launch import bench, chaos, cli_flags, config, link_probe, stores, train
from tests.helpers import ROOT

COMMANDS = {"train": train, "bench": bench, "chaos": chaos, "stores": stores,
            "link_probe": link_probe}
# A command's own flag under a shared name: chaos's --seed seeds the trial
# draws (its DESIGN.md contract), not the job.
OWN = {("chaos", "seed")}


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
    want = config.AcceleratorConfig(accelerator="none", profile="")
    assert config.from_flags(fv).accelerator == want
    fv = train.define_flags(flags.FlagValues())
    fv(["train", f"--workdir={tmp_path}", "--accelerator=emulated",
        "--accelerator_profile=h200_gpt_moe_125m_8e"])
    want = config.AcceleratorConfig(accelerator="emulated", profile="h200_gpt_moe_125m_8e")
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


def test_shared_flags_differ_only_in_the_declared_defaults():
    train_fv = train.define_flags(flags.FlagValues())
    for name, module, own in (("bench", bench, bench.BENCH_DEFAULTS),
                              ("chaos", chaos, chaos.CHAOS_DEFAULTS)):
        fv = module.define_flags(flags.FlagValues())
        differ = {f: fv[f].default for f in fv
                  if f in train_fv and fv[f].default != train_fv[f].default}
        assert differ == own, name


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
names = sorted(m.name for m in pkgutil.walk_packages(launch.__path__, "launch."))
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
    assert {"launch.train", "launch.bench", "launch.chaos", "launch.cli_flags"} <= set(
        out["modules"])
    assert out["added"] == []
