"""The GPT family: pinned sizes, causality, kv-cache decoding, config errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import decoding, models
from transformer.models import gpt

# Parameter counts per preset (gpt2-*: Hugging Face's GPT-2 checkpoints, tied embeddings).
PINNED = {
    "tiny": 1_853_568,
    "tiny-moe": 5_413_248,  # tiny's attention, 8 experts of width 384 in each Block
    "tiny-long": 1_828_992,  # tiny less its 128 learned positions (rotary)
    "gpt2-small": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "gpt3-175b": 175_221_817_344,
    "llama-tiny": 1_722_048,
    "llama3-8b": 8_030_261_248,  # Meta-Llama-3-8B
    "llama3-70b": 70_553_706_496,  # Meta-Llama-3-70B
    "mistral-7b": 7_241_732_096,  # Mistral-7B-v0.1
}


@pytest.mark.parametrize("preset", sorted(gpt.PRESETS))
def test_pinned_parameter_counts(preset):
    assert preset in PINNED, f"preset {preset!r} has no pinned parameter count"
    assert models.count_params(gpt.default_model_config(preset)) == PINNED[preset]


def small_model(**overrides):
    cfg = gpt.default_model_config("tiny")
    cfg.update(num_layers=2, d_model=32, num_heads=4, mlp_dim=64, max_len=24, vocab_size=50)
    cfg.update(overrides)
    return gpt.build(cfg)


MODELS = {
    "learned": {},
    "rotary-gqa-swiglu-rms": dict(positions="rotary", num_kv_heads=2, activation="swiglu", norm="rmsnorm"),
    "sinusoidal-untied-mqa": dict(positions="sinusoidal", tie_embeddings=False, num_kv_heads=1),
    "experts-swiglu-shared": dict(num_experts=4, experts_per_token=2, activation="swiglu", shared_expert_dim=16,
                                  moe_dispatch="dense"),  # (jax.jacobian's vmap cannot batch a grouped matmul)
}


@pytest.mark.parametrize("variant", sorted(MODELS))
def test_causality_by_gradients(variant):
    """The logits at t have zero gradient w.r.t. the inputs after t, and non-zero up to t."""
    model = small_model(**MODELS[variant])
    tokens = jax.random.randint(jax.random.key(1), (1, 10), 0, 50)
    params = model.init(jax.random.key(0), tokens)["params"]
    t = 6
    jac = jax.jacobian(lambda d: _logits_with_delta(model, params, tokens, d)[0, t].sum())(
        jnp.zeros((1, 10, 32)))
    influence = jnp.abs(jac[0]).sum(-1)  # [L]
    assert bool((influence[: t + 1] > 0).all())
    np.testing.assert_array_equal(np.asarray(influence[t + 1:]), 0.0)


def _logits_with_delta(model, params, tokens, delta):
    """Logits when `delta` [B, L, D] is added to the token embeddings."""
    def add_delta(next_fn, args, kwargs, context):
        out = next_fn(*args, **kwargs)
        if context.module.name == "embed" and context.method_name == "__call__":
            return out + delta
        return out
    with nn.intercept_methods(add_delta):
        return model.apply({"params": nn.unbox(params)}, tokens)


@pytest.mark.parametrize("variant", sorted(MODELS))
def test_kv_cache_decoding_equals_full_forward(variant):
    model = small_model(**MODELS[variant])
    tokens = jax.random.randint(jax.random.key(2), (2, 20), 0, 50)
    params = nn.unbox(model.init(jax.random.key(0), tokens)["params"])
    full = model.apply({"params": params}, tokens)
    cache = decoding.init_cache(model, 2)
    logits, variables = model.apply({"params": params, "cache": cache}, tokens[:, :7], decode=True,
                                    mutable=["cache"])
    steps = [logits]
    for t in range(7, 20):
        logits, variables = model.apply({"params": params, "cache": variables["cache"]}, tokens[:, t:t + 1],
                                        decode=True, mutable=["cache"])
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=1e-5)


def test_greedy_generation_equals_argmax_of_full_forward():
    model = small_model(positions="rotary")
    prompt = jax.random.randint(jax.random.key(3), (2, 4), 0, 50)
    params = nn.unbox(model.init(jax.random.key(0), prompt)["params"])
    new = decoding.generate(model, params, prompt, jax.random.key(0), max_new_tokens=12, temperature=0.0)
    logits = model.apply({"params": params}, jnp.concatenate([prompt, new], 1))  # [B, 16, V]
    np.testing.assert_array_equal(np.asarray(new), np.asarray(jnp.argmax(logits[:, 3:-1], -1)))


def test_sampling_respects_top_k_and_top_p():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    draws = lambda **kw: {int(decoding.sample_logits(logits, jax.random.key(i), **kw)[0]) for i in range(200)}
    assert draws(temperature=1.0, top_k=2) == {0, 1}
    assert draws(temperature=1.0, top_p=0.7) == {0, 1}
    assert draws(temperature=1.0) == {0, 1, 2, 3}
    assert draws(temperature=0.0) == {0}


@pytest.mark.parametrize("overrides,match", [
    (dict(d_model=30), "config.model.d_model=30 is not divisible by num_heads=4"),
    (dict(num_kv_heads=3), "config.model.num_heads=4 is not a multiple of num_kv_heads=3"),
    (dict(positions="alibi"), "config.model.positions='alibi'"),
    (dict(bogus=1), "unknown config.model keys for the gpt family: bogus"),
])
def test_inconsistent_model_config_fails_naming_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        small_model(**overrides)


def test_completion_longer_than_the_context_continues_in_windows():
    model = small_model(max_len=16)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])

    class Ids:
        def encode(self, text):
            return np.array([int(t) for t in text.split()], np.int32)

        def decode(self, ids):
            return " ".join(str(int(i)) for i in ids)

    long = decoding.complete(model, params, Ids(), "1 2 3", 40, temperature=0.0)[0].split()
    short = decoding.complete(model, params, Ids(), "1 2 3", 13, temperature=0.0)[0].split()
    assert len(long) == 40 and long[:13] == short
    window = [int(t) for t in long[5:13]]  # the second window starts from the last 8 tokens
    after = decoding.generate(model, params, jnp.array([window]), jax.random.key(0), max_new_tokens=8,
                              temperature=0.0)
    assert [int(t) for t in after[0]] == [int(t) for t in long[13:21]]


def test_greedy_is_argmax_with_ties_and_infinities():
    from transformer import decoding
    logits = jnp.asarray([[0.0, 3.0, 3.0, 1.0], [-jnp.inf, -1.0, -jnp.inf, -1.0], [jnp.inf, 0.0, jnp.inf, 2.0]])
    np.testing.assert_array_equal(decoding.greedy(logits), jnp.argmax(logits, -1))
    random = jnp.asarray(np.random.default_rng(0).normal(size=(8, 1000)), jnp.float32)
    np.testing.assert_array_equal(decoding.greedy(random), jnp.argmax(random, -1))
