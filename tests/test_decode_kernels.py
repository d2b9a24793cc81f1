"""A decode step's attention on the platforms' paged kernels (kernels/paged.py), checked on a CPU: the GPU's
(Triton, in Pallas's interpreter) and the TPU's (Mosaic, in the TPU interpreter) over slots at different
positions equal the CPU path under the engine's vmap, the engine decoding through the GPU kernel gives the
uncached forward's greedy tokens, the engine's decode call lowered for CUDA holds the kernel, and what the
kernels refuse falls back, said once. The TPU compile of the decode call is in test_tpu."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_gpu_attention import TRITON, lower_for_cuda

from transformer import parallel
from transformer.inference import decoding, engine, sampling
from transformer.layers.attention import Mask, attend, platforms
from transformer.layers.attention.kernels import paged
from transformer.models import gpt

GPU = paged.rows_merged(functools.partial(paged.gpu, interpret=True))


def slots(kv_heads=2, groups=3, positions=64, dh=16, dtype=jnp.float32, seed=0):
    """q [S, 1, 1, H, Dh], k, v [S, 1, K, C, Dh] (S = 3 batch-1 caches, as the engine keeps them), each
    slot's last written position."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(3, 1, 1, kv_heads * groups, dh)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(3, 1, kv_heads, positions, dh)), dtype) for _ in range(2))
    return q, k, v, jnp.array([4, positions - 1, 20])


def cpu_path(q, k, v, index):
    """What the CPU runs: the cache's causal positions, attend(auto) over the swapped cache, slot by slot."""
    def one(q, k, v, i):
        mask = Mask(causal=True, query_positions=i + jnp.arange(1), key_positions=jnp.arange(k.shape[2]))
        return attend(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), mask, "auto")
    return jax.vmap(one)(q, k, v, index)


def as_the_engine(kernel, q, k, v, index):
    return jax.jit(jax.vmap(lambda q, k, v, i: kernel(q, k, v, i + 1)))(q, k, v, index)


@pytest.mark.parametrize("kv_heads,groups", [(2, 3), (4, 1), (1, 4)])
def test_the_gpu_kernel_over_slots_equals_the_cpu_path(kv_heads, groups):
    q, k, v, index = slots(kv_heads, groups)
    np.testing.assert_allclose(as_the_engine(GPU, q, k, v, index), cpu_path(q, k, v, index), atol=2e-6)


def test_the_tpu_kernel_over_slots_equals_the_cpu_path_in_bfloat16():
    q, k, v, index = slots(dh=128, dtype=jnp.bfloat16)
    with pltpu.force_tpu_interpret_mode():
        ours = as_the_engine(paged.rows_merged(paged.tpu), q, k, v, index)
    want = cpu_path(*(x.astype(jnp.float32) for x in (q, k, v)), index)
    np.testing.assert_allclose(ours.astype(jnp.float32), want, atol=3e-2)


def tiny():
    cfg = gpt.default_model_config("tiny")
    cfg.update(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=64, max_len=32, vocab_size=40,
               positions="rotary")
    model = gpt.build(cfg)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    return model, jax.tree.map(lambda x: x * 8, params)


PROMPTS = [[1, 2, 3], list(range(5, 22)), [9]]


def uncached_greedy(model, params, prompts, new=8):
    forward = jax.jit(lambda ids: model.apply({"params": params}, ids))  # [1, 32] -> [1, 32, V]
    answers = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(new):
            ids.append(int(jnp.argmax(forward(jnp.asarray([ids + [0] * (32 - len(ids))]))[0, len(ids) - 1])))
        answers.append(ids[len(prompt):])
    return answers


@pytest.mark.parametrize("devices", [1, 8])
def test_the_engine_through_the_gpu_kernel_gives_the_uncached_greedy_tokens(monkeypatch, devices):
    """On one device, and with the slots split over the 8 fake devices (each its rows' kernel: jax.shard_map
    under the engine's `jax.set_mesh`)."""
    model, params = tiny()
    calls = []
    monkeypatch.setitem(platforms.PAGED, "gpu", paged.rows_merged(
        lambda *args: calls.append(args[0].shape) or paged.gpu(*args, interpret=True)))
    monkeypatch.setattr(platforms, "decode", lambda *args, otherwise: platforms.paged_step("gpu", otherwise, *args))
    mesh = parallel.make_mesh({"data": -1}, jax.devices()[:devices]) if devices > 1 else None
    requests = [engine.Request(p, sampling.Sampling(max_new_tokens=8)) for p in PROMPTS + PROMPTS[:1]]
    engine.Engine(model.clone(attention="flash" if mesh else "auto"), params, slots=8, mesh=mesh).run(requests)
    assert [r.tokens[0] for r in requests] == uncached_greedy(model, params, PROMPTS + PROMPTS[:1])
    assert (8 // devices, 1, 4, 16) in calls  # the decode call: each device's slots in one kernel


def test_the_engines_decode_call_lowered_for_cuda_holds_the_paged_kernel():
    model, params = tiny()
    model = model.clone(cache_length=32, dtype=jnp.bfloat16)
    cache = jax.tree.map(lambda x: jnp.zeros((4, *x.shape), x.dtype), decoding.cache_shapes(model, 1))
    rows = jax.tree.map(jnp.asarray, engine.slot_rows(4))
    text = lower_for_cuda(jax.jit(functools.partial(decoding.decode_slots, model, steps=2)), params, cache, rows)
    assert TRITON in text and re.search(r'name = "paged_attention_block_h_16\w*"', text)


def test_what_the_kernels_refuse_falls_back_and_is_said_once(monkeypatch, capsys):
    q, k, v, index = (x[:, 0] if x.ndim > 1 else x for x in slots(dh=64, dtype=jnp.bfloat16))
    assert paged.refusal(q, k, "tpu") == "head width 64: TPU's paged kernel needs a multiple of 128"
    assert paged.refusal(q, k, "gpu") is None
    assert paged.refusal(q, k[:, :, :40], "gpu") == "a cache of 40 positions, not a multiple of 16"
    two = jnp.concatenate([q, q], 1)
    assert paged.refusal(two, k, "gpu") == "2 queries a row (the paged kernel takes one new token)"
    monkeypatch.setattr(platforms, "platform", lambda: "tpu")
    monkeypatch.setattr(platforms, "_SAID", set())
    mask = Mask(causal=True, query_positions=jnp.arange(1), key_positions=jnp.arange(64))
    otherwise = lambda q, k, v, lengths, mask: jnp.zeros_like(q)  # noqa: E731
    for _ in range(2):
        jaxpr = str(jax.make_jaxpr(lambda *a: platforms.paged_step("tpu", otherwise, *a, mask))(q, k, v, index + 1))
        assert "pallas_call" not in jaxpr
    assert capsys.readouterr().err.count("decode attention: head width 64") == 1
    biased = mask.replace(key_valid=jnp.ones((3, 64), bool))
    jaxpr = str(jax.make_jaxpr(lambda *a: platforms.paged_step("gpu", otherwise, *a, biased))(q, k, v, index + 1))
    assert "pallas_call" not in jaxpr
