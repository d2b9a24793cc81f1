"""Layers: attention maths and masks, rotary, mlp, block placements."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.layers import attention, embeddings
from transformer.layers.attention import masks, xla
from transformer.layers.block import Block
from transformer.layers.mlp import Mlp


def naive_attention(q, k, v, mask):
    logits = jnp.einsum("blhd,bshd->bhls", q, k) / np.sqrt(q.shape[-1])
    logits = jnp.where(mask, logits, -1e30)
    return jnp.einsum("bhls,bshd->blhd", jax.nn.softmax(logits, -1), v)


def test_attend_matches_naive_with_causal_and_padding():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 5, 4, 8)), jnp.float32) for _ in range(3))
    valid = jnp.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    mask = masks.Mask(causal=True, key_valid=valid)
    assert mask.dense(5, 5).shape == (2, 1, 5, 5)
    for implementation in ("auto", "dense", "blockwise"):
        np.testing.assert_allclose(attention.attend(q, k, v, mask, implementation, block=2),
                                   naive_attention(q, k, v, mask.dense(5, 5)), atol=1e-5)


def test_grouped_query_attention_equals_repeated_kv_heads():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 6, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 6, 2, 8)), jnp.float32) for _ in range(2))
    mask = xla.causal_mask(6)
    grouped = xla.dot_product_attention(q, k, v, mask)
    full = naive_attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), mask)
    np.testing.assert_allclose(grouped, full, atol=1e-5)


def test_attention_bias_is_added_to_logits():
    q = k = v = jnp.ones((1, 3, 2, 4))
    bias = jnp.zeros((1, 2, 3, 3)).at[..., 0].set(-1e9)
    out = xla.dot_product_attention(q, k, v.at[:, 0].set(100.0), bias=bias)
    np.testing.assert_allclose(out, jnp.ones_like(out), atol=1e-5)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_makes_attention_blind_to_the_scale_of_each_heads_queries_and_keys(qk_norm):
    """Each head's query and key is normed over Dh (one [Dh] scale shared by the heads): scaling the
    query and key kernels, a head at a time, changes nothing; without qk_norm it changes the output."""
    layer = attention.MultiHeadAttention(num_heads=4, head_dim=8, num_kv_heads=2, use_bias=False, qk_norm=qk_norm,
                                         norm_epsilon=1e-12, rope=embeddings.Rope())
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, 16)), jnp.float32)
    params = nn.unbox(layer.init(jax.random.key(0), x)["params"])
    assert ("query_norm" in params and params["key_norm"]["scale"].shape == (8,)) == qk_norm
    scaled = jax.tree.map(lambda p: p, params)
    for name, heads in (("query", 4), ("key", 2)):
        scaled[name]["kernel"] = params[name]["kernel"] * 8 * jnp.arange(1.0, 1.0 + heads)[:, None]  # [D, heads, Dh]
    out, out_scaled = (layer.apply({"params": p}, x, mask=masks.Mask(causal=True)) for p in (params, scaled))
    if qk_norm:
        np.testing.assert_allclose(out_scaled, out, rtol=1e-4, atol=1e-7)
    else:
        assert np.abs(out_scaled - out).max() > 0.1 * np.abs(out).max()


def test_rotary_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)

    def score(i, j):
        return float(jnp.sum(embeddings.apply_rotary(q, jnp.array([i])) * embeddings.apply_rotary(k, jnp.array([j]))))

    assert score(3, 1) == pytest.approx(score(10, 8), rel=1e-4)
    assert score(3, 1) != pytest.approx(score(3, 2), rel=1e-3)


def test_sinusoidal_table_matches_the_paper():
    table = embeddings.sinusoidal_positions(7, 6)
    pos, i = 5, 2
    assert float(table[pos, 2 * i]) == pytest.approx(np.sin(pos / 1e4 ** (2 * i / 6)), abs=1e-6)
    assert float(table[pos, 2 * i + 1]) == pytest.approx(np.cos(pos / 1e4 ** (2 * i / 6)), abs=1e-6)


@pytest.mark.parametrize("activation,kernels", [("gelu", 2), ("relu", 2), ("swiglu", 3)])
def test_mlp_shapes(activation, kernels):
    x = jnp.ones((2, 3, 8))
    mlp = Mlp(16, activation)
    params = nn.unbox(mlp.init(jax.random.key(0), x)["params"])
    assert mlp.apply({"params": params}, x).shape == x.shape
    assert len(params) == kernels


def test_unknown_activation_fails_clearly():
    with pytest.raises(ValueError, match="unknown mlp activation 'tanh'"):
        Mlp(4, "tanh").init(jax.random.key(0), jnp.ones((1, 1, 4)))


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_block_with_cross_attention(placement, norm):
    x, enc = jnp.ones((2, 3, 16)), jnp.ones((2, 5, 16))
    block = Block(num_heads=4, head_dim=4, mlp_dim=32, norm=norm, norm_placement=placement)
    variables = block.init(jax.random.key(0), x, encoded=enc)
    out = block.apply(variables, x, encoded=enc)
    assert out.shape == x.shape and bool(jnp.isfinite(out).all())
    assert "cross_attn" in variables["params"]
    if placement == "post" and norm == "layernorm":
        np.testing.assert_allclose(out.mean(-1), 0.0, atol=1e-5)


def test_parameters_carry_logical_axis_names():
    block = Block(num_heads=4, head_dim=4, mlp_dim=32)
    specs = nn.get_partition_spec(block.init(jax.random.key(0), jnp.ones((1, 2, 16))))["params"]
    assert tuple(specs["self_attn"]["query"]["kernel"]) == ("embed", "heads", "head_dim")
    assert tuple(specs["self_attn"]["out"]["kernel"]) == ("heads", "head_dim", "embed")
    assert tuple(specs["mlp"]["up"]["kernel"]) == ("embed", "mlp")
