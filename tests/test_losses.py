"""The language model's loss over blocks of positions (`cross_entropy.blockwise_token_losses`,
`model.loss_block`), its soft cap and z-loss, and the cross entropy whose backward is one elementwise
pass (`cross_entropy.integer_cross_entropy`), both in `transformer/layers/cross_entropy.py`."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FAST_COMPILES, REPO
from test_ring import compiled_step
from test_scale import train_losses

from transformer import config as config_lib
from transformer.layers import cross_entropy
from transformer.models import gpt
from transformer.training import checks

TOKENS = np.random.default_rng(0).integers(0, 64, (2, 25))


def small(**overrides) -> gpt.GPT:
    return gpt.GPT(**dict(vocab_size=64, num_layers=1, d_model=16, num_heads=2, mlp_dim=32, max_len=32) | overrides)


def losses_and_grads(model, params):
    """(per-token losses [B, L], the gradient of their mean) on TOKENS."""
    inputs, targets = TOKENS[:, :-1], TOKENS[:, 1:]
    loss = lambda p: model.apply({"params": p}, inputs, targets=targets)
    return loss(params), jax.grad(lambda p: loss(p).mean())(params)


@pytest.mark.slow
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-6), ("bfloat16", 2e-2)])
def test_blocks_give_the_losses_and_gradients_of_the_whole_logits(tie, dtype, tolerance):
    whole = small(tie_embeddings=tie, dtype=dtype)
    params = whole.init(jax.random.PRNGKey(0), TOKENS[:, :-1])["params"]
    logits = whole.apply({"params": params}, TOKENS[:, :-1])
    one, one_grads = losses_and_grads(whole, params)
    np.testing.assert_allclose(cross_entropy.token_losses(logits, TOKENS[:, 1:]), one, rtol=1e-6)
    wanted = dict(jax.tree_util.tree_leaves_with_path(one_grads))
    for block in (8, 5, 1):  # 24 positions: 3 blocks of 8, 6 of 4, 24 of 1
        got, grads = losses_and_grads(small(tie_embeddings=tie, dtype=dtype, loss_block=block), params)
        np.testing.assert_allclose(got, one, rtol=tolerance, atol=tolerance, err_msg=f"block {block}")
        for path, g in jax.tree_util.tree_leaves_with_path(grads):
            want = wanted[path]
            np.testing.assert_allclose(g, want, rtol=tolerance, atol=tolerance * np.abs(want).max(),
                                       err_msg=f"block {block}, {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("block", [24, 8])
def test_the_soft_cap_and_the_z_loss_come_through_the_blocks_as_from_the_whole_logits(block):
    """Capped logits stay within the cap; their cross entropy, log Z and the gradient of a z-loss on them
    are the whole logits' (one block, and three)."""
    model, cap, z = small(logit_softcap=0.1, loss_block=block), 0.1, 0.5
    inputs, targets = TOKENS[:, :-1], TOKENS[:, 1:]
    params = model.init(jax.random.PRNGKey(0), inputs)["params"]
    uncapped = small().apply({"params": params}, inputs)
    assert np.abs(uncapped).max() > cap > np.abs(model.apply({"params": params}, inputs)).max()

    def whole(p):
        logits = model.apply({"params": p}, inputs)
        return cross_entropy.token_losses(logits, targets), cross_entropy.log_partition(logits)

    def blocks(p):
        return model.apply({"params": p}, inputs, targets=targets, log_z=True)

    objective = lambda per_token: lambda p: (per_token(p)[0] + z * jnp.square(per_token(p)[1])).mean()
    for got, want in zip(blocks(params), whole(params)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    got, want = (jax.grad(objective(f))(params) for f in (blocks, whole))
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7), got, want)


@pytest.mark.slow
def test_the_z_loss_adds_its_weight_times_log_z_squared_to_the_loss(tmp_path, small_gpt_config):
    """At init the logits are near 0 and log Z near log V (V = 256 bytes)."""
    plain, _ = train_losses(small_gpt_config(), tmp_path / "plain", steps=1)
    with_z, _ = train_losses(small_gpt_config("train.z_loss=0.01"), tmp_path / "z", steps=1)
    np.testing.assert_allclose(with_z[0] - plain[0], 0.01 * np.log(256) ** 2, rtol=1e-2)


@pytest.mark.parametrize("spec, override, match", [
    ("gpt.py:tiny", "train.z_loss=-1.0", r"config.train.z_loss=-1.0 must be >= 0 \(0: none\)"),
    ("vit.py:tiny", "train.z_loss=0.001", "config.train.z_loss=0.001: the z-loss is a language model's"),
])
def test_a_z_loss_below_0_or_on_a_classifier_fails_naming_the_key(spec, override, match):
    with pytest.raises(ValueError, match=match):
        checks.validate(config_lib.load(os.path.join(REPO, "configs", spec), [override]))


def test_the_fewest_blocks_that_divide_the_length():
    assert [cross_entropy._blocks(24, b) for b in (24, 100, 8, 7, 5, 1)] == [1, 1, 3, 4, 6, 24]
    assert cross_entropy._blocks(13, 4) == 13  # a prime length: blocks of one position
    with pytest.raises(ValueError, match="positive"):
        cross_entropy._blocks(24, 0)


def widest_logits(hlo: str) -> int:
    """The most rows of any float32 array of width V = 256 (the byte vocabulary) in a compiled step."""
    return max(np.prod(list(map(int, dims.split(",")))) for dims in re.findall(r"f32\[([\d,]+),256\]", hlo))


def test_the_blockwise_step_never_holds_the_whole_logits(tmp_path, small_gpt_config):
    """Each of the 8 devices holds a row of 16 positions: its logits [16, V], in blocks of 4 [4, V]."""
    config = small_gpt_config()
    rows = config.data.batch_size * config.data.seq_len // jax.device_count()
    assert widest_logits(compiled_step(tmp_path / "whole", config)) == rows
    assert widest_logits(compiled_step(tmp_path / "blocks", small_gpt_config("model.loss_block=4"))) == rows // 4


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["mesh.data=2,mesh.tensor=4", "mesh.fsdp=2,mesh.context=2,mesh.tensor=2"])
def test_blocks_on_a_mesh_train_as_the_whole_logits_on_one_device(tmp_path, small_gpt_config, mesh):
    """Blocks of 4 of 16 positions, the vocabulary split over the tensor axis, the length over the context axis."""
    ring = ("model.attention=ring", "model.attention_block=4") if "context" in mesh else ()
    one, _ = train_losses(small_gpt_config(*ring), tmp_path / "one", jax.devices()[:1])
    blocked, _ = train_losses(small_gpt_config(*ring, "model.loss_block=4", *mesh.split(",")), tmp_path / "mesh")
    np.testing.assert_allclose(blocked, one, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_backward_gives_autodiffs_numbers_exactly(dtype):
    """Losses and gradients bit for bit, through a head's cast of bf16 logits as in a bf16 GPT; one row's
    logits all -inf but the target's, another with a -inf class."""
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(3, 5, 40)) * 4).astype(np.float32)
    logits[0, 0, :] = -np.inf
    logits[0, 0, 7] = 2.0
    logits[1, 2, 3] = -np.inf
    targets = rng.integers(0, 40, (3, 5))
    targets[0, 0] = 7
    weights = rng.uniform(size=(3, 5)).astype(np.float32)
    logits = jnp.asarray(logits, dtype)

    def loss_and_grad(fn):
        loss = lambda x: (fn(x.astype(jnp.float32), targets) * weights).sum()
        return jax.jit(jax.value_and_grad(loss))(logits)

    (want, want_grad), (got, got_grad) = map(loss_and_grad, (optax.softmax_cross_entropy_with_integer_labels,
                                                           cross_entropy.integer_cross_entropy))
    assert got_grad.dtype == logits.dtype
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_grad.astype(np.float32), want_grad.astype(np.float32))


# XLA's own CPU defaults, which the tests' FAST_COMPILES (conftest.py) change: the fusions as a run gets them
XLA_DEFAULTS = {"xla_backend_optimization_level": 3} | (
    {"xla_cpu_use_fusion_emitters": True} if "fusion_emitters" in FAST_COMPILES else {})


def test_the_fused_backward_is_one_elementwise_pass():
    """The backward writes no float32 [M, V] array and scatters nothing: the softmax and the target's -1 are
    one fusion with the cast to the bf16 logits' gradient (the float32 arrays left are the forward's)."""
    logits, targets = jnp.zeros((64, 512), jnp.bfloat16), jnp.zeros((64,), jnp.int32)

    def float32_arrays(fused: bool) -> list[str]:
        loss = lambda x: cross_entropy.token_losses(x.astype(jnp.float32), targets, fused_backward=fused).sum()
        entry = jax.jit(jax.grad(loss)).lower(logits).compile(XLA_DEFAULTS).as_text().split("ENTRY")[1]
        return re.findall(r"%([\w.-]+) = f32\[64,512\]", entry)

    assert any("scatter" in name for name in float32_arrays(False))
    assert len(float32_arrays(True)) == len(float32_arrays(False)) - 2 == 2
