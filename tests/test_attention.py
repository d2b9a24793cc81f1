"""One attention over a mask description: the mask's meaning, blockwise against the dense reference
(outputs and gradients) for every mask kind, families on blockwise, sliding-window decoding, the
memory blockwise needs and the FLOPs a window counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import models
from transformer.inference import decoding, engine, sampling
from transformer.layers import attention
from transformer.layers.attention import Bias, BlockSparse, Mask, xla
from transformer.models.flops import forward_flops

B, H, K, DH = 2, 4, 2, 8


def relative_bias(params, q_pos, k_pos):
    """T5-like: a learned [17, H] table indexed by the clipped distance -> [H, bq, bk]."""
    distance = jnp.clip(k_pos[None, :] - q_pos[:, None], -8, 8) + 8
    return jnp.moveaxis(params[distance], -1, 0)


def inputs(length, source_length, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, length, H, DH)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, source_length, K, DH)), jnp.float32) for _ in range(2))
    return q, k, v, jnp.asarray(rng.normal(size=(17, H)), jnp.float32)


def mask_kinds(length, source_length):
    rng = np.random.default_rng(1)
    valid = jnp.asarray(rng.random((B, source_length)) > 0.2)
    segments = jnp.asarray(np.sort(rng.integers(0, 4, (B, source_length)), axis=1))
    nothing = valid.at[0].set(False)  # row 0's queries see no key at all
    return {
        "causal": Mask(causal=True),
        "padding": Mask(key_valid=valid),
        "segments": Mask(causal=True, segments=segments[:, source_length - length:], key_segments=segments),
        "window": Mask(causal=True, window=(5, 0)),
        "window+globals": Mask(window=(4, 4), global_tokens=3, key_valid=valid),
        "block-sparse": Mask(sparse=BlockSparse(block=8, global_blocks=1, window_blocks=3, random_blocks=2)),
        "bias": Mask(causal=True, bias=Bias(None, relative_bias)),
        "sees-nothing": Mask(causal=True, key_valid=nothing),
    }


def run(mask, implementation, q, k, v, bias_params):
    """(output, gradients of q, k, v, bias params) of a loss that weighs every output differently."""
    def loss(q, k, v, params):
        m = mask if mask.bias is None else mask.replace(bias=Bias(params, relative_bias))
        out = attention.attend(q, k, v, m, implementation, block=16)
        return jnp.sum(jnp.sin(out) * jnp.arange(out.size).reshape(out.shape) / out.size), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, bias_params)
    return (out, *grads)


@pytest.mark.parametrize("length,source_length", [(53, 53), (37, 53)])
@pytest.mark.parametrize("kind", list(mask_kinds(1, 1)))
def test_blockwise_equals_dense_forward_and_gradients(kind, length, source_length):
    q, k, v, bias_params = inputs(length, source_length)
    mask = mask_kinds(length, source_length)[kind]
    dense = run(mask, "dense", q, k, v, bias_params)
    blocked = run(mask, "blockwise", q, k, v, bias_params)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), dense, blocked):
        assert np.all(np.isfinite(b)), (kind, name)
        scale = float(jnp.max(jnp.abs(a))) or 1.0
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * scale, (kind, name)
    if kind == "sees-nothing":
        for x in blocked[:2]:  # output and dq of the queries that see nothing
            assert float(jnp.max(jnp.abs(x[0]))) == 0.0


def test_a_query_that_sees_nothing_gets_zero_from_every_implementation():
    q, k, v, _ = inputs(6, 6)
    mask = Mask(causal=True, key_valid=jnp.zeros((B, 6), bool).at[1].set(True))
    for implementation in attention.IMPLEMENTATIONS:
        out, dq, dk, dv, _ = run(mask, implementation, q, k, v, jnp.zeros((17, H)))
        assert float(jnp.abs(out[0]).max()) == 0 and float(jnp.abs(dq[0]).max()) == 0, implementation
        assert float(jnp.abs(dk[0]).max()) == 0 and float(jnp.abs(out[1]).max()) > 0, implementation


def test_the_mask_means_what_its_docstring_says():
    dense = lambda m, q, k: np.asarray(m.dense(q, k))[0, 0].astype(int)
    # causal bottom-right: 2 queries over 4 keys sit at positions 2 and 3
    np.testing.assert_array_equal(dense(Mask(causal=True), 2, 4), [[1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(dense(Mask(causal=True, window=(1, 0)), 4, 4),
                                  [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]])
    glob = dense(Mask(window=(0, 0), global_tokens=1), 4, 4)  # position 0 sees and is seen by all
    np.testing.assert_array_equal(glob, [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]])
    segments = jnp.array([[0, 0, 1, 1]])
    np.testing.assert_array_equal(dense(Mask(segments=segments), 4, 4)[1], [1, 1, 0, 0])
    sparse = BlockSparse(block=2, global_blocks=1, window_blocks=1, random_blocks=1, seed=3)
    table = sparse.table(8)
    assert table[:, 0].all() and table[0].all() and np.all(table.sum(1)[1:] == 3)  # global, self, one random
    np.testing.assert_array_equal(dense(Mask(sparse=sparse), 8, 8), np.kron(table, np.ones((2, 2), int)))


def test_blockwise_skips_the_blocks_a_window_excludes():
    length, window, block = 4096, 256, 128
    full = Mask(causal=True).computed_pairs(length, length, "blockwise", block)
    windowed = Mask(causal=True, window=(window - 1, 0)).computed_pairs(length, length, "blockwise", block)
    assert full == (32 * 33 // 2) * block * block  # the diagonal and below
    assert windowed == (32 + 31 + 30) * block * block  # a query block's 255 keys back reach 2 blocks back
    assert Mask(causal=True).computed_pairs(length, length, "dense", block) == length * length


def test_flops_count_what_a_window_computes(small_gpt_config):
    config = small_gpt_config("model.max_len=2048", "model.attention=blockwise", "model.attention_block=128",
                              "data.seq_len=2048")
    full = forward_flops(config)["per_example"]
    config.model.window = 128
    windowed = forward_flops(config)["per_example"]
    width, layers = config.model.d_model, config.model.num_layers
    blocks = lambda n: n * 128 * 128
    assert full - windowed == 4 * layers * width * (blocks(16 * 17 // 2) - blocks(16 + 15))


@pytest.mark.slow
@pytest.mark.parametrize("family,overrides", [
    ("gpt", dict(window=8)),
    ("bert", dict(window=8, global_tokens=1)),
    ("encdec", dict(window=8)),
    ("vit", dict()),
])
def test_every_family_runs_blockwise_as_it_runs_dense(family, overrides):
    config = models.family(family).model_config("tiny") | overrides | dict(dropout=0.0)
    dense, blocked = (models.build(config | dict(attention=impl, attention_block=16))
                      for impl in ("dense", "blockwise"))
    rng = np.random.default_rng(0)
    if family == "vit":
        args = (jnp.asarray(rng.normal(size=(2, config["image_size"], config["image_size"], config["channels"])),
                            jnp.float32),)
    else:
        tokens = jnp.asarray(rng.integers(1, 100, (2, 40)), jnp.int32)
        valid = jnp.ones((2, 40), bool).at[1, 30:].set(False)
        args = {"gpt": (tokens, valid), "bert": (tokens, jnp.zeros_like(tokens), valid),
                "encdec": (tokens, tokens[:, :24], valid)}[family]
    params = dense.init(jax.random.key(0), *args)
    out_dense, out_blocked = dense.apply(params, *args), blocked.apply(params, *args)
    for a, b in zip(jax.tree.leaves(out_dense), jax.tree.leaves(out_blocked)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_sliding_window_decoding_keeps_a_window_sized_cache_and_matches_the_full_pass():
    window = 16
    config = models.family("gpt").model_config("tiny") | dict(window=window, positions="rotary", max_len=128,
                                                              attention="blockwise", attention_block=16)
    model = models.build(config)
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 5)), jnp.int32)
    params = model.init(jax.random.key(0), prompt)["params"]
    new = np.array(engine.new_tokens(model, params, np.asarray(prompt).tolist(),
        sampling.Sampling(max_new_tokens=4 * window)))
    cache = decoding.init_cache(decoding.sized_cache(model, 5 + 4 * window), 2)
    slots = {x.shape[2] if x.ndim == 4 else x.shape[1] for x in jax.tree.leaves(cache) if x.ndim >= 2}
    assert slots == {window}  # keys, values [B, K, W, Dh]; positions [B, W]
    full = jnp.concatenate([prompt, new], axis=1)
    logits = model.apply({"params": params}, full[:, :-1])
    np.testing.assert_array_equal(jnp.argmax(logits[:, 4:], -1), new)


def test_blockwise_memory_grows_linearly_in_length():
    """Compiled temporary memory of a GPT's loss gradient at L and 4L: blockwise ~4x, dense ~16x."""
    def temp(implementation, length):
        config = models.family("gpt").model_config("tiny") | dict(
            max_len=length, positions="rotary", attention=implementation, attention_block=256, num_layers=1)
        model = models.build(config)
        tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
        params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
        loss = lambda p, t: jnp.mean(model.apply({"params": p}, t) ** 2)
        return jax.jit(jax.grad(loss)).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

    blockwise = temp("blockwise", 4096) / temp("blockwise", 1024)
    dense = temp("dense", 4096) / temp("dense", 1024)
    assert blockwise < 5 and dense > 10, (blockwise, dense)


def test_an_unknown_implementation_or_a_bad_window_fails_naming_the_key():
    config = models.family("gpt").model_config("tiny")
    with pytest.raises(ValueError, match="config.model.attention='sparse'"):
        models.build(config | dict(attention="sparse"))
    with pytest.raises(ValueError, match="config.model.window=-1"):
        models.build(config | dict(window=-1))
    with pytest.raises(ValueError, match="config.model.attention_block=0"):
        models.build(config | dict(attention_block=0))


@pytest.mark.parametrize("length", [53, 300])  # one query block; five (64 each), the last one short
def test_the_low_precision_causal_path_equals_dense_forward_and_gradients(length):
    """`causal_attention` (its own backward) against autodiff of the dense reference, in float32;
    bfloat16 q, k, v take it in `auto`'s CPU path and keep their dtype in every gradient."""
    q, k, v, _ = inputs(length, length)
    weights = jnp.arange(q.size).reshape(q.shape) / q.size
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v).astype(jnp.float32)) * weights)
    dense = lambda q, k, v: attention.attend(q, k, v, Mask(causal=True), "dense")
    ours = jax.jit(jax.value_and_grad(loss(xla.causal_attention), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(loss(dense), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(ours)):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(jnp.max(jnp.abs(a)))
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    auto = lambda q, k, v: attention.attend(q, k, v, Mask(causal=True), "auto")
    cpu_path = lambda q, k, v: xla.attention(q, k, v, Mask(causal=True))
    takes_it = lambda *a: "custom_vjp_call" in str(jax.make_jaxpr(cpu_path)(*a))
    assert takes_it(*low) and not takes_it(q, k, v)
    grads = jax.jit(jax.grad(loss(auto), argnums=(0, 1, 2)))(*low)
    for a, b in zip(want[1], grads):
        assert b.dtype == jnp.bfloat16
        assert float(jnp.max(jnp.abs(a - b.astype(jnp.float32)))) <= 2e-2 * float(jnp.max(jnp.abs(a)))
