"""ALiBi (`model.positions=alibi`): BLOOM's slopes for any head count; every implementation (dense, blockwise,
the XLA path, ring over the context axis, the Pallas GPU kernel in its interpreter, heads split over the
tensor axis) against the dense reference, forward and gradients; attention at long range decaying as the
slopes say; a GPT's cached decoding equal to its full pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_gpu_attention import INTERPRETED
from test_ring import mesh_of

from transformer import models, sharding
from transformer.inference import decoding, engine, sampling
from transformer.layers import attention
from transformer.layers.attention import Mask, alibi, blockwise, platforms

B, H, K, DH = 2, 6, 2, 8  # six heads: BLOOM's slopes past the power of two


def inputs(length, source_length, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, length, H, DH)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, source_length, K, DH)), jnp.float32) for _ in range(2))
    return q, k, v, jnp.asarray(alibi.slopes(H))


def run(mask, implementation, q, k, v, slopes):
    """(output, gradients of q, k, v, slopes) of a loss that weighs every output differently; `implementation`
    a name of IMPLEMENTATIONS or a function of (q, k, v, mask)."""
    attend = implementation if callable(implementation) else (
        lambda q, k, v, m: attention.attend(q, k, v, m, implementation, block=16))

    def loss(q, k, v, slopes):
        out = attend(q, k, v, mask.replace(bias=alibi.bias(H).replace(params=slopes)))
        return jnp.sum(jnp.sin(out) * jnp.arange(out.size).reshape(out.shape) / out.size), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, slopes)
    return (out, *grads)


def assert_equal_to_dense(mask, implementation, length=37, source_length=53, tolerance=1e-5):
    q, k, v, slopes = inputs(length, source_length)
    dense = run(mask, "dense", q, k, v, slopes)
    ours = run(mask, implementation, q, k, v, slopes)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dslopes"), dense, ours):
        assert np.all(np.isfinite(b)), name
        assert float(jnp.max(jnp.abs(a - b))) <= tolerance * (float(jnp.max(jnp.abs(a))) or 1.0), name


def test_the_slopes_are_blooms_for_any_head_count():
    np.testing.assert_allclose(alibi.slopes(8), 2.0 ** -np.arange(1, 9), rtol=1e-7)  # 2^(-8/8 i)
    np.testing.assert_allclose(alibi.slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3], rtol=1e-7)
    torch = pytest.importorskip("torch")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    for heads in (1, 3, 5, 12, 16, 40, 112):
        theirs = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)[:, 0, 1].numpy()
        np.testing.assert_allclose(alibi.slopes(heads), theirs, rtol=1e-6, err_msg=str(heads))


MASKS = {"causal": Mask(causal=True), "causal+padding": Mask(causal=True, key_valid=jnp.ones((B, 53), bool).at[1, 40:]
                                                                .set(False)),
         "bidirectional": Mask(), "window": Mask(causal=True, window=(9, 0))}


@pytest.mark.parametrize("implementation,kind", [("blockwise", kind) for kind in MASKS] + [
    ("auto", "causal+padding"), ("auto", "bidirectional")])  # auto: the XLA path on CPU (flash: blockwise)
def test_every_implementation_equals_dense_with_alibi(implementation, kind):
    assert_equal_to_dense(MASKS[kind], implementation)


@pytest.mark.parametrize("kind", ["causal", "causal+padding"])
def test_the_pallas_kernel_equals_dense_with_alibi(kind):
    kernel = lambda q, k, v, m: blockwise.attention(q, k, v, m, 16, kernel=INTERPRETED)
    assert_equal_to_dense(MASKS[kind], kernel)


@pytest.mark.parametrize("sizes", [dict(data=1, context=8), dict(data=1, fsdp=2, context=2, tensor=2)])
def test_ring_attention_equals_dense_with_alibi_and_heads_split_over_tensor(sizes):
    mesh, rules = mesh_of(sizes)

    def ringed(q, k, v, mask):
        with sharding.sharding_context(mesh, rules):
            return attention.attend(q, k, v, mask, "ring", block=4)
    assert_equal_to_dense(MASKS["causal"], ringed, 64, 64)


def test_each_device_of_the_tensor_axis_biases_its_own_heads():
    """The kernels' shard_map (`platforms.on_shards`) splits the heads with their slopes over tensor=2."""
    mesh, rules = mesh_of(dict(data=2, context=2, tensor=2))  # the length stays whole: context is idle

    def split(q, k, v, mask):
        with sharding.sharding_context(mesh, rules):
            assert platforms.bias_specs(mask.bias, rules).params == jax.sharding.PartitionSpec("tensor")
            return platforms.on_shards(blockwise.attention, q, k, v, mask, block=16)
    assert_equal_to_dense(MASKS["causal"], split)


def test_attention_at_long_range_decays_as_the_slopes_say():
    """With equal scores, a query's weight on a key d positions back is exp(-slope d) of its weight on itself."""
    length = 200
    slopes = alibi.slopes(H)
    v = jnp.broadcast_to(jnp.eye(length)[None, :, None, :], (1, length, K, length))  # output = the weights
    q, k = jnp.zeros((1, length, H, length)), jnp.zeros_like(v)  # every score 0
    for implementation in ("dense", "blockwise"):
        weights = attention.attend(q, k, v, Mask(causal=True, bias=alibi.bias(H)), implementation,
                                   block=64)[0, -1]  # [H, S] of the last query
        distance = length - 1 - np.arange(length)
        for h in range(H):
            expected = np.exp(-float(slopes[h]) * distance)
            expected /= expected.sum()
            normal = expected > 1e-35  # float32's normal range
            np.testing.assert_allclose(np.asarray(weights[h])[normal], expected[normal], rtol=1e-4)
            assert np.all(np.asarray(weights[h])[~normal] < 1e-30)
    assert float(weights[4, 0]) < 1e-30 and float(weights[3, 0]) > 1e-3  # slope 2^-1 forgets 199 back, 2^-8 not


def test_a_gpt_with_alibi_decodes_with_its_cache_as_its_full_pass():
    config = models.family("gpt").model_config("tiny") | dict(positions="alibi", embed_norm=True, num_heads=6,
                                                              d_model=96, mlp_dim=192, num_layers=2)
    model = models.build(config)
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 5)), jnp.int32)
    params = model.init(jax.random.key(0), prompt)["params"]
    assert "pos_embed" not in params and "embed_norm" in params
    new = np.array(engine.new_tokens(model, params, np.asarray(prompt).tolist(),
        sampling.Sampling(max_new_tokens=8)))
    full = jnp.concatenate([prompt, new], axis=1)
    logits = model.apply({"params": params}, full)
    np.testing.assert_array_equal(jnp.argmax(logits[:, 4:-1], -1), new)
    cached = decoding.sized_cache(model, full.shape[1])
    apply = jax.jit(lambda cache, tokens: cached.apply({"params": params, "cache": cache}, tokens, decode=True,
                                                       mutable=["cache"]))
    step, variables = apply(decoding.init_cache(cached, 2), full[:, :9])  # a prefill, then one token at a time
    steps = [step]
    for i in range(9, full.shape[1]):
        step, variables = apply(variables["cache"], full[:, i:i + 1])
        steps.append(step)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), logits, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_an_alibi_gpt_trains_with_its_heads_over_tensor_and_its_length_over_context_as_on_one_device(
        tmp_path, small_gpt_config):
    """Ring attention with each device's slopes for its own heads (mesh.tensor=2), in a whole train step."""
    from test_scale import train_losses
    config = lambda *sizes: small_gpt_config("model.positions=alibi", "model.embed_norm=True", "model.dropout=0.0",
                                             "model.attention=ring", "model.attention_block=4", *sizes)
    one, _ = train_losses(config(), tmp_path / "one", jax.devices()[:1], steps=3)
    split, _ = train_losses(config("mesh.data=2", "mesh.context=2", "mesh.tensor=2"), tmp_path / "split", steps=3)
    np.testing.assert_allclose(split, one, rtol=1e-5)
