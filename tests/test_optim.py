"""Optimizers and schedules (transformer/training/optim.py): each schedule against its closed form,
each optimizer's step against its formula or optax's own transformation, Muon's matrices read as
matrices, a tiny GPT trained by each, and the config checks."""

import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO

from transformer import config as config_lib
from transformer import models
from transformer.layers import moe
from transformer.training import checks, loop, optim, shapes
from transformer.training import metrics as metrics_lib

LR, WARMUP, STEPS, END = 2e-3, 10, 100, 0.1


def schedule(steps=STEPS, **overrides):
    c = config_lib.optim_config(lr=LR, warmup_steps=WARMUP, final_lr_fraction=END)
    c.update(overrides)
    optim.check(c)
    return optim.make_schedule(c, steps)


def closed_form(name, t, warmup=WARMUP, steps=STEPS, decay_fraction=0.2, cooldown="linear"):
    end = LR * END
    if t < warmup:
        return LR * t / warmup
    progress = (t - warmup) / (steps - warmup)
    if name == "constant":
        return LR
    if name == "cosine":
        return end + (LR - end) * 0.5 * (1 + math.cos(math.pi * min(progress, 1)))
    if name == "linear":
        return LR + (end - LR) * min(progress, 1)
    if name == "inverse_sqrt":
        return LR * math.sqrt(max(warmup, 1) / max(t, warmup, 1))
    start = max(warmup, steps - round(decay_fraction * steps))  # wsd
    done = min(max(t - start, 0) / (steps - start), 1)
    return LR + (end - LR) * (done if cooldown == "linear" else math.sqrt(done))


TIMES = [0, 1, 5, 9, 10, 11, 30, 50, 79, 80, 81, 90, 99, 100, 120]


@pytest.mark.parametrize("name", ["cosine", "constant", "linear", "inverse_sqrt", "wsd"])
def test_each_schedule_follows_its_closed_form(name):
    got = [float(schedule(schedule=name)(t)) for t in TIMES]
    np.testing.assert_allclose(got, [closed_form(name, t) for t in TIMES], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("cooldown, decay_fraction", [("linear", 0.3), ("1-sqrt", 0.2), ("1-sqrt", 1.0)])
def test_wsd_is_stable_then_decays_over_its_final_fraction(cooldown, decay_fraction):
    got = [float(schedule(schedule="wsd", cooldown=cooldown, decay_fraction=decay_fraction)(t)) for t in TIMES]
    want = [closed_form("wsd", t, decay_fraction=decay_fraction, cooldown=cooldown) for t in TIMES]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
    assert got[TIMES.index(100)] == pytest.approx(LR * END)


def test_inverse_sqrt_without_warmup_is_lr_over_root_step_and_warmup_is_capped_by_the_steps():
    got = [float(schedule(schedule="inverse_sqrt", warmup_steps=0)(t)) for t in (0, 1, 4, 100)]
    np.testing.assert_allclose(got, [LR, LR, LR / 2, LR / 10], rtol=1e-6)
    # a warmup longer than the run ends one step before its end, as cosine's always did
    short = schedule(steps=5, schedule="linear", warmup_steps=50)
    np.testing.assert_allclose([float(short(t)) for t in (0, 2, 4, 5)], [0, LR / 2, LR, LR * END], rtol=1e-6)


# --- one step of each optimizer ------------------------------------------------------------------

D, H, DH, F, V, N = 16, 2, 8, 24, 40, 3


def model_like_params(key):
    """A tree named and laid out as the families' params are: attention kernels [D, H, Dh] and
    [H, Dh, D], a scanned stack's kernels with a leading layers axis, embeddings, head, norms, biases."""
    shapes = {
        "embed": {"embedding": (V, D)},
        "block_0": {"self_attn": {"query": {"kernel": (D, H, DH), "bias": (H, DH)},
                                  "out": {"kernel": (H, DH, D), "bias": (D,)}},
                    "mlp": {"up": {"kernel": (D, F)}}, "mlp_norm": {"scale": (D,)}},
        "blocks": {"block": {"self_attn": {"key": {"kernel": (N, D, H, DH)}, "out": {"kernel": (N, H, DH, D)}},
                             "mlp": {"down": {"kernel": (N, F, D)}, "down_norm": {"scale": (N, D)}}}},
        "unembed": {"kernel": (D, V)},
    }
    leaves, tree = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [jax.random.normal(k, s) for k, s in zip(keys, leaves)])


MUON = {"block_0/self_attn/query/kernel", "block_0/self_attn/out/kernel", "block_0/mlp/up/kernel",
        "blocks/block/self_attn/key/kernel", "blocks/block/self_attn/out/kernel", "blocks/block/mlp/down/kernel"}


def flat(tree) -> dict:
    return {"/".join(k.key for k in path): x for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def steps_of(optimizer, params, grads, **overrides):
    """The updates of config.optim's optimizer, constant lr LR and no warmup, one per gradient."""
    c = config_lib.optim_config(optimizer=optimizer, lr=LR, warmup_steps=0, schedule="constant", clip_norm=0.0)
    c.update(overrides)
    tx, _ = optim.make_optimizer(c, STEPS)
    state, out = tx.init(params), []
    for g in grads:
        updates, state = tx.update(g, state, params)
        out.append(updates)
        params = optax.apply_updates(params, updates)
    return out


def flat_boxed(tree) -> dict:
    boxed = lambda x: isinstance(x, nn.meta.AxisMetadata)
    return {"/".join(k.key for k in path): x
            for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=boxed)[0]}


def decays(name: str) -> bool:
    return name.rsplit("/", 1)[-1] not in ("bias", "scale")


@pytest.fixture
def params():
    return model_like_params(jax.random.key(0))


def gradients(count):
    return [model_like_params(jax.random.key(i + 1)) for i in range(count)]


def test_adamw_first_step_is_the_sign_like_step_plus_decay_off_norms_and_biases(params):
    (g,) = gradients(1)
    (update,) = steps_of("adamw", params, [g], weight_decay=0.1)
    p, g = flat(params), flat(g)
    for name, u in flat(update).items():  # m / sqrt(v) = g / |g| after bias correction
        want = -LR * (g[name] / (jnp.abs(g[name]) + 1e-8) + (0.1 * p[name] if decays(name) else 0))
        np.testing.assert_allclose(u, want, rtol=1e-5, atol=1e-9, err_msg=name)


@pytest.mark.parametrize("family, fields", [
    ("gpt", {}), ("gpt", dict(scan_layers=True, num_experts=4, experts_per_token=2, moe_mlp_dim=16)), ("bert", {}),
    ("vit", dict(pool="cls")), ("encdec", dict(positions="relative", logits_bias=True, scan_layers=True)),
])
def test_weight_decay_takes_the_kernels_and_embeddings_of_every_family_and_spares_every_vector(family, fields):
    """A vector (one axis besides the layers and expert axes: a bias, BERT's mlm_bias, a norm scale)
    never decays; T5's relative-position bias tables do not either; kernels and embeddings do."""
    config = models.family(family).model_config("tiny")
    config.update(fields)
    if "vocab_size" in config:
        config["vocab_size"] = config["vocab_size"] or 64
    boxed = models.param_shapes(config)
    mask = flat(optim.decay_mask(nn.unbox(boxed)))
    names = {n: tuple(x.names) for n, x in flat_boxed(boxed).items()}
    assert {n for n, axes in names.items() if len([a for a in axes if a not in optim.BATCHES]) == 1} & \
        {n for n, decayed in mask.items() if decayed} == set()
    taken = ("kernel", "embedding", "type_embed", "cls", *moe.EXPERT_KERNELS)
    assert {n for n, decayed in mask.items() if decayed} == {n for n in mask if n.rsplit("/", 1)[-1] in taken}
    assert ("mlm_bias" in mask) == (family == "bert") and ("src_rel_bias" in mask) == (family == "encdec")


def test_lion_steps_by_the_sign_of_the_interpolated_momentum(params):
    g1, g2 = gradients(2)
    u1, u2 = steps_of("lion", params, [g1, g2], weight_decay=0.5, lion_b1=0.9, lion_b2=0.99)
    p1, f1, f2 = flat(params), flat(g1), flat(g2)
    p2 = flat(optax.apply_updates(params, u1))
    for name in p1:
        decay = 0.5 if decays(name) else 0.0
        np.testing.assert_allclose(flat(u1)[name], -LR * (jnp.sign(f1[name]) + decay * p1[name]), rtol=1e-6,
                                   err_msg=name)
        momentum = 0.01 * f1[name]  # (1 - b2) g1
        np.testing.assert_allclose(flat(u2)[name], -LR * (jnp.sign(0.9 * momentum + 0.1 * f2[name])
                                                          + decay * p2[name]), rtol=1e-6, err_msg=name)


def test_adafactor_is_optax_adafactor_with_decoupled_decay(params):
    grads = gradients(3)
    big = {"block_0": {"mlp": {"up": {"kernel": jax.random.normal(jax.random.key(9), (128, 256))}}},
           "final_norm": {"scale": jnp.ones(256)}}  # factored: both axes reach min_dim_size_to_factor
    for tree, gs in ((params, grads), (big, [jax.tree.map(lambda x, s=s: x * s, big) for s in (1.0, -2.0, 0.5)])):
        got = steps_of("adafactor", tree, gs, weight_decay=0.1, adafactor_decay_rate=0.8, adafactor_clip=1.0)
        reference = optax.adafactor(LR, decay_rate=0.8, clipping_threshold=1.0, weight_decay_rate=LR * 0.1,
                                    weight_decay_mask=optim.decay_mask)
        state, p = reference.init(tree), tree
        for g, u in zip(gs, got):
            want, state = reference.update(g, state, p)
            p = optax.apply_updates(p, want)
            for name, x in flat(u).items():
                np.testing.assert_allclose(x, flat(want)[name], rtol=1e-5, atol=1e-10, err_msg=name)


def boxed(shape, names):
    return nn.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names)


def boxes_of(optimizer, params) -> tuple[list, list]:
    """(shapes and names of the boxed leaves, shapes of the bare array leaves) of the optimizer's state."""
    tx, _ = optim.make_optimizer(config_lib.optim_config(optimizer=optimizer), STEPS)
    leaves = jax.tree.leaves(jax.eval_shape(tx.init, params), is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
    kept = [(x.value.shape, x.names) for x in leaves if isinstance(x, nn.meta.AxisMetadata)]
    return kept, sorted(x.shape for x in leaves if not isinstance(x, nn.meta.AxisMetadata))


def test_the_optimizer_state_keeps_the_params_axes_only_where_it_has_their_shape():
    """What the loop shards by the params' logical axes (and checkpoints by that placement)."""
    params = {"mlp": {"up": {"kernel": boxed((128, 256), ("embed", "mlp"))}},
              "norm": {"scale": boxed((256,), ("norm",))}}
    kernel, norm = ((128, 256), ("embed", "mlp")), ((256,), ("norm",))
    assert boxes_of("adamw", params) == ([kernel, norm] * 2, [(), ()])  # mu, nu; two counts
    # Adafactor: the norm's full second moment; the kernel's row and column and the MaskedNode entries bare
    assert boxes_of("adafactor", params) == ([norm], [(), (), (), (1,), (1,), (1,), (128,), (256,)])
    # Muon: its momentum of the kernel, AdamW's of the norm; no box around a masked-out entry
    assert boxes_of("muon", params) == ([norm, norm, kernel], [(), (), (), (), (3,)])


def as_matrices(tree):
    """Each Muon matrix of `model_like_params` as the 2-D matrix (per layer) it stands for."""
    f = flat(tree)
    return {
        "q": f["block_0/self_attn/query/kernel"].reshape(D, H * DH),
        "o": f["block_0/self_attn/out/kernel"].reshape(H * DH, D),
        "up": f["block_0/mlp/up/kernel"],
        **{f"k{i}": f["blocks/block/self_attn/key/kernel"][i].reshape(D, H * DH) for i in range(N)},
        **{f"o{i}": f["blocks/block/self_attn/out/kernel"][i].reshape(H * DH, D) for i in range(N)},
        **{f"d{i}": f["blocks/block/mlp/down/kernel"][i] for i in range(N)},
    }


@pytest.mark.parametrize("rms", [0.2, 0.0])
def test_muon_orthogonalises_each_hidden_matrix_and_gives_the_rest_adamws_step(params, rms):
    assert {name for name, label in flat(optim.muon_labels(params)).items() if label == "muon"} == MUON
    grads = gradients(2)
    updates = steps_of("muon", params, grads, weight_decay=0.1, muon_rms=rms, muon_momentum=0.95,
                       muon_ns_steps=5, muon_adamw_lr_scale=0.5)
    # the hidden matrices: optax's Muon run on the 2-D matrices they stand for (each layer its own)
    reference = optax.contrib.muon(LR, beta=0.95, ns_steps=5, weight_decay=0.1, consistent_rms=rms or None)
    state, p = reference.init(as_matrices(params)), as_matrices(params)
    for g, u in zip(grads, updates):
        want, state = reference.update(as_matrices(g), state, p)
        p = optax.apply_updates(p, want)
        got = as_matrices(u)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=2e-4, atol=1e-7, err_msg=name)
    # ... whose singular values Newton-Schulz brings near one: the update is an orthogonal matrix, scaled
    first = as_matrices(updates[0])
    decay = as_matrices(params)
    for name, u in first.items():
        scale = math.sqrt(max(u.shape)) * rms if rms else math.sqrt(max(1, u.shape[1] / u.shape[0]))
        singular = jnp.linalg.svd((u / -LR - 0.1 * decay[name]) / scale, compute_uv=False)
        assert 0.5 < float(singular.min()) and float(singular.max()) < 1.5, (name, singular)
    # the rest (embedding, head, norms, biases): AdamW's first step at lr x muon_adamw_lr_scale
    p, g = flat(params), flat(grads[0])
    for name, u in flat(updates[0]).items():
        if name not in MUON:
            want = -0.5 * LR * (g[name] / (jnp.abs(g[name]) + 1e-8) + (0.1 * p[name] if decays(name) else 0))
            np.testing.assert_allclose(u, want, rtol=1e-5, atol=1e-9, err_msg=name)


def test_muon_takes_the_hidden_kernels_of_every_family():
    """The matrices `matrix_axes` finds by name agree with the params' logical axes (check_muon)."""
    for spec, overrides, count in [  # q, k, v, out, up, down per layer (and a gate, BERT's transform)
        ("gpt.py:tiny", [], 6 * 4), ("gpt.py:tiny", ["model.scan_layers=True"], 6),
        ("gpt.py:tiny", ["model.tie_embeddings=False", "model.activation=swiglu", "model.num_kv_heads=2"], 7 * 4),
        ("bert.py:tiny", [], 6 * 4 + 1), ("vit.py:tiny", [], 6 * 3),
        ("encdec.py:tiny", ["model.scan_layers=True"], 6 + 10),  # the decoder's stack adds cross-attention
    ]:
        config = shapes.resolved(config_lib.load(os.path.join(REPO, "configs", spec), ["optim.optimizer=muon",
                                                                                          *overrides]))
        checks.validate(config)
        labels = optim.muon_labels(nn.unbox(models.param_shapes(config.model)))
        assert list(jax.tree.leaves(labels)).count("muon") == count, (spec, overrides)


def test_muon_refuses_a_model_without_hidden_matrices_or_with_a_layout_it_misreads():
    no_matrix = {"embed": {"embedding": boxed((V, D), ("vocab", "embed"))},
                 "final_norm": {"scale": boxed((D,), ("norm",))},
                 "unembed": {"kernel": boxed((D, V), ("embed", "vocab"))}}
    with pytest.raises(ValueError, match=r"^config.optim.optimizer=muon: config.model has no hidden weight matrix"):
        optim.check_muon(no_matrix)
    experts = {"moe": {"up": {"kernel": boxed((4, D, F), ("expert", "embed", "mlp"))}}}
    with pytest.raises(ValueError, match=r"^config.optim.optimizer=muon: parameter moe/up/kernel \(4, 16, 24\)"):
        optim.check_muon(experts)
    head = {"lm_head": {"kernel": boxed((D, V), ("embed", "vocab"))}}
    with pytest.raises(ValueError, match=r"parameter lm_head/kernel .* teach"):
        optim.check_muon(head)


@pytest.mark.parametrize("override, message", [
    ("optim.optimizer=sgd", "config.optim.optimizer='sgd': choose one of adamw, muon, adafactor, lion"),
    ("optim.schedule=step", "config.optim.schedule='step': choose one of cosine, constant, wsd, linear, inverse_sqrt"),
    ("optim.cooldown=cosine", "config.optim.cooldown='cosine': choose one of linear, 1-sqrt"),
    ("optim.decay_fraction=0.0", "config.optim.decay_fraction=0.0 must be in (0, 1]"),
    ("optim.decay_fraction=1.5", "config.optim.decay_fraction=1.5 must be in (0, 1]"),
    ("optim.muon_momentum=1.0", "config.optim.muon_momentum=1.0 must be in [0, 1)"),
    ("optim.muon_ns_steps=0", "config.optim.muon_ns_steps=0 must be at least 1"),
    ("optim.muon_rms=-0.2", "config.optim.muon_rms=-0.2 must not be negative"),
    ("optim.muon_adamw_lr_scale=0.0", "config.optim.muon_adamw_lr_scale=0.0 must be in (0, inf)"),
    ("optim.adafactor_clip=0.5", "config.optim.adafactor_clip=0.5 must be at least 1 (0: no clipping)"),
    ("optim.adafactor_decay_rate=0.0", "config.optim.adafactor_decay_rate=0.0 must be in (0, 1]"),
    ("optim.lion_b2=1.0", "config.optim.lion_b2=1.0 must be in [0, 1)"),
    ("optim.b2=1.5", "config.optim.b2=1.5 must be in [0, 1)"),
])
def test_a_bad_optim_key_fails_in_one_line_naming_it(small_gpt_config, override, message):
    with pytest.raises(ValueError) as error:
        checks.validate(small_gpt_config(override))
    assert str(error.value) == message


# --- training ------------------------------------------------------------------------------------

def train_losses(config, workdir) -> dict:
    loop.train(config, str(workdir))
    return {r["step"]: r["train/loss"] for r in metrics_lib.read(str(workdir / "metrics.jsonl")) if "train/loss" in r}


@pytest.mark.parametrize("overrides", [
    ["optim.optimizer=muon", "optim.schedule=wsd"],
    ["optim.optimizer=lion", "optim.lr=1e-3", "optim.schedule=linear"],
], ids=["muon", "lion"])
def test_a_tiny_gpt_learns_with_each_optimizer(tmp_path, small_gpt_config, overrides):
    losses = train_losses(small_gpt_config("train.sample_tokens=0", *overrides), tmp_path)
    assert losses_fall(losses), losses


MESH = ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4"]


@pytest.mark.parametrize("overrides", [
    ["optim.optimizer=muon", "model.scan_layers=True"],
    ["optim.optimizer=adafactor", "optim.lr=0.1", "optim.schedule=inverse_sqrt"],  # steps relative to the weights
], ids=["muon-scanned", "adafactor"])
def test_a_run_paused_on_a_sharded_mesh_resumes_like_one_never_paused(tmp_path, small_gpt_config, overrides):
    """Learns, and its optimizer state (Muon's masked partition, Adafactor's factored statistics)
    shards over FSDP and tensor axes, saves and restores onto another mesh."""
    config = lambda *more: small_gpt_config("train.sample_tokens=0", *overrides, *more)
    whole = train_losses(config(), tmp_path / "whole")
    assert losses_fall(whole)
    train_losses(config("train.stop_at=3", *MESH), tmp_path / "paused")
    paused = train_losses(config(), tmp_path / "paused")
    assert sorted(paused) == list(range(1, 7))
    np.testing.assert_allclose([paused[s] for s in range(1, 7)], [whole[s] for s in range(1, 7)], rtol=2e-5)


def losses_fall(losses: dict) -> bool:
    return sorted(losses) == list(range(1, 7)) and losses[6] < losses[1] - 0.1
