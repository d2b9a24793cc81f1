"""The benchmark harness runs and prints sane numbers; attention's fast paths match the reference.

Speed is never asserted here: only that the numbers exist, are finite and positive.
"""

import math
import os
import subprocess
import sys
import types

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAST_COMPILES

from transformer.bench import measure, peer, peer_process, torch_models
from transformer.layers.attention import masks, xla
from transformer.training import mfu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def naive_attention(q, k, v, mask=None, bias=None):
    """q [B, L, H, Dh], k, v [B, S, K, Dh] (kv heads repeated) -> [B, L, H, Dh]."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    logits = jnp.einsum("blhd,bshd->bhls", q, k) / np.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = jnp.where(mask, logits, -1e30)
    return jnp.einsum("bhls,bshd->blhd", jax.nn.softmax(logits, -1), v)


def qkv(length, heads, kv_heads, seed=0, dh=8):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(2, length, heads, dh)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, length, kv_heads, dh)), jnp.float32) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("length,heads,kv_heads", [(200, 4, 2), (5, 4, 1)])
def test_blocked_causal_attention_matches_reference_with_gradients(length, heads, kv_heads):
    q, k, v = qkv(length, heads, kv_heads)
    mask = xla.causal_mask(length)
    assert xla._is_causal(mask, length, length)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) ** 2)
    ours = jax.jit(jax.value_and_grad(loss(lambda q, k, v: xla.dot_product_attention(q, k, v, mask)),
                                      argnums=(0, 1, 2)))(q, k, v)
    ref = jax.value_and_grad(loss(lambda q, k, v: naive_attention(q, k, v, mask)), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_causal_detection_only_takes_the_plain_causal_mask():
    assert not xla._is_causal(xla.causal_mask(4, 6, offset=2), 4, 6)  # a decode window
    assert not xla._is_causal(np.ones((1, 1, 4, 4), bool), 4, 4)
    assert not xla._is_causal(jnp.asarray(xla.causal_mask(4)), 4, 4)  # not a trace-time constant
    traced = jax.jit(lambda i: xla.causal_mask(2, 4, offset=i))(jnp.int32(1))
    np.testing.assert_array_equal(traced, xla.causal_mask(2, 4, offset=1))


def test_the_xla_formulation_matches_reference_with_masks_gqa_and_bias():
    """The CPU/TPU path of auto on the same inputs as a naive reference."""
    q, k, v = qkv(6, 4, 2, seed=1)
    valid = jnp.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], bool)
    mask = masks.Mask(causal=True, key_valid=valid).dense(6, 6)  # [2, 1, 6, 6]
    bias = jnp.asarray(np.random.default_rng(2).normal(size=(1, 4, 6, 6)), jnp.float32)
    for m, b in [(mask, None), (None, bias), (mask, bias), (xla.causal_mask(6)[0, 0], None)]:
        np.testing.assert_allclose(xla._xla_attention(q, k, v, m, b), naive_attention(q, k, v, m, b), atol=1e-5)


def test_nominal_peak_by_device_kind():
    assert mfu.nominal_peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert mfu.nominal_peak("NVIDIA A100-SXM4-40GB", "float32") == 156e12
    assert mfu.nominal_peak("TPU v5 lite", "bfloat16") == 197e12
    assert mfu.nominal_peak("TPU v5p", "bfloat16") == 459e12
    assert mfu.nominal_peak("cpu", "float32") is None
    assert mfu.nominal_bandwidth("NVIDIA H200") == 4.8e12 and mfu.nominal_bandwidth("cpu") is None


ARGS = dict(steps=2, warmup=1, rounds=2, prompt_len=4, new_tokens=4, gen_rounds=1, hf_eager=True,
            gen_batches=[2], hf_threads=0)


def test_train_and_generate_print_sane_numbers(small_gpt_config, capsys):
    config = small_gpt_config()
    args = types.SimpleNamespace(**ARGS)
    train = measure.bench_train(config, args, theirs_too=False)
    gen = measure.bench_generate(config, args, theirs_too=False)
    out = capsys.readouterr().out
    assert "tokens/s" in out and "MFU" in out and "compile" in out and "peak memory" in out
    assert train["items_per_s"] > 0 and train["step_s"] > 0 and math.isfinite(train["loss"])
    assert train["measured_peak"] > 0 and train["flops_per_s"] > 0
    stats = gen["ours_b2"]
    assert stats["tokens_per_s"] > 0 and stats["prefill_ms"] > 0 and math.isfinite(stats["decode_ms"])


@pytest.mark.slow
@pytest.mark.torch
def test_vs_hf_times_the_same_model_in_torch(small_gpt_config, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    config = small_gpt_config()
    args = types.SimpleNamespace(**{**ARGS, "rounds": 1, "steps": 1})
    result = measure.bench_train(config, args, theirs_too=True)
    assert result["hf_items_per_s"] > 0 and result["ratio"] > 0
    assert "ratio ours/hf" in capsys.readouterr().out
    import torch
    import transformers
    hf = torch_models.hf_gpt(config, torch, transformers)
    from transformer import models
    assert sum(p.numel() for p in hf.parameters()) == models.count_params(config.model)


@pytest.mark.torch
def test_vs_torch_is_the_same_model_loss_and_greedy_tokens(small_gpt_config, tmp_path, capsys):
    """The nanoGPT-style peer: our parameter count, and loaded with our initial params, our step-0
    loss on the same batch (within 1e-4) and our greedy tokens from its static-cache decoder."""
    torch = pytest.importorskip("torch")
    from transformer import models
    from transformer.bench import torch_gpt
    from transformer.inference import engine, sampling
    config = small_gpt_config()
    ours = measure.Ours.build(config, str(tmp_path))
    params = jax.device_get(ours.run.state.params)
    nano = torch_gpt.build(config, models.count_params(config.model))  # asserts the count
    assert sum(p.numel() for p in nano.parameters()) == models.count_params(config.model)
    assert nano.lm_head.weight is nano.transformer.wte.weight
    torch_gpt.load(nano, peer.initial_weights(params, config))
    tokens = torch.from_numpy(np.asarray(ours.run.task.train_batch(0)["tokens"], np.int64))
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(nano(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    ours.steps(1)  # step 0: the loss of the initial params
    assert abs(float(loss) - ours.loss) < 1e-4, (float(loss), ours.loss)

    prompt, new = tokens[:3, :5].numpy().astype(np.int32), 7
    decoder = torch_gpt.Decoder(nano, compile_model=False)
    theirs = decoder.generate(prompt, new, torch_gpt.cache_length(config, 5 + new))
    assert theirs.shape == (3, new)
    model = models.build(config.model)
    mine = np.array(engine.new_tokens(model, flax.linen.unbox(params), prompt.tolist(),
        sampling.Sampling(max_new_tokens=new)))
    np.testing.assert_array_equal(theirs, np.asarray(mine)[:, -new:])

    for key, value in [("norm", "rmsnorm"), ("positions", "rotary"), ("activation", "swiglu"),
                       ("num_kv_heads", 2), ("window", 8), ("tie_embeddings", False), ("dtype", "float16")]:
        with pytest.raises(ValueError, match=f"config.model.{key}="):
            torch_gpt.check({**config.model.to_dict(), key: value})


@pytest.mark.slow
@pytest.mark.torch
def test_vs_torch_trains_and_generates_in_the_bench(small_gpt_config, capsys):
    pytest.importorskip("torch")
    config = small_gpt_config()
    args = types.SimpleNamespace(**{**ARGS, "rounds": 1, "steps": 1})
    train = measure.bench_train(config, args, theirs_too="torch")
    gen = measure.bench_generate(config, args, theirs_too="torch")
    out = capsys.readouterr().out
    assert "ratio ours/torch training" in out and "ratio ours/torch generation" in out
    assert out.count("its own process") == 2
    assert train["peer"] == "torch" and train["hf_items_per_s"] > 0 and math.isfinite(train["hf_loss"])
    assert gen["torch_b2"]["tokens_per_s"] > 0 and gen["ratio_b2"] > 0


@pytest.mark.slow
@pytest.mark.torch
def test_vs_torch_in_bfloat16_trains_the_peer_under_autocast(small_gpt_config, capsys):
    pytest.importorskip("torch")
    config = small_gpt_config("model.dtype=bfloat16")
    args = types.SimpleNamespace(**{**ARGS, "rounds": 1, "steps": 1})
    train = measure.bench_train(config, args, theirs_too="torch")
    assert train["peer"] == "torch" and math.isfinite(train["hf_loss"]) and math.isfinite(train["loss"])
    assert "compute bfloat16" in capsys.readouterr().out


@pytest.mark.torch
def test_the_peer_trains_with_our_learning_rate_schedule(small_gpt_config, tmp_path):
    """Warmup from 0 as ours: the peer's AdamW takes the schedule's value of each step."""
    pytest.importorskip("torch")
    from transformer import models
    config = small_gpt_config()
    lrs = peer.schedule_values(config)
    assert lrs[0] == 0.0 and lrs[config.optim.warmup_steps] == pytest.approx(config.optim.lr)
    ours = measure.Ours.build(config, str(tmp_path))
    batches = [np.asarray(ours.run.task.train_batch(s)["tokens"]) for s in range(3)]
    weights = peer.initial_weights(ours.run.state.params, config)
    theirs = peer_process.Theirs(config, models.count_params(config.model), weights, batches[0], lrs, "cpu",
                               compile_model=False, kind="torch")
    for step, batch in enumerate(batches):
        theirs.steps([batch])
        assert [g["lr"] for g in theirs.opt.param_groups] == [pytest.approx(float(lrs[step]))] * 2
    assert "threads" in theirs.describe()


def test_the_peer_process_drops_only_the_single_arena_and_reports_its_failures(monkeypatch):
    from transformer import hostmem
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)  # set to cpu for the peer's process only, then unset again
    monkeypatch.setenv("GLIBC_TUNABLES", ":".join(f"{k}={v}" for k, v in hostmem.TUNABLES.items()))
    assert peer.child_tunables() == ":".join(f"{k}={v}" for k, v in hostmem.TUNABLES.items()
                                             if k != "glibc.malloc.arena_max")
    with peer.Process() as child:
        with pytest.raises(RuntimeError, match="failed in 'steps'(.|\n)*KeyError: 'train'"):
            child("steps", [])  # no model built there yet
    assert os.environ["GLIBC_TUNABLES"].count("arena_max") == 1  # this process's own settings are back
    assert "JAX_PLATFORMS" not in os.environ


@pytest.mark.slow
@pytest.mark.torch
def test_the_command_runs_the_peer_in_its_own_process():
    """`python -m transformer.bench --vs torch`: the peer's loop is found in the child although the
    command's module runs as __main__ there."""
    pytest.importorskip("torch")
    from tests.conftest import SMALL_GPT
    spec = ",".join(["configs/gpt.py:tiny", *SMALL_GPT])
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILES}
    out = subprocess.run([sys.executable, "-m", "transformer.bench", "--config", spec, "--vs", "torch", "--steps", "1",
                          "--warmup", "1", "--mode", "all", "--hf_eager", "--gen_batches", "1", "--gen_rounds", "1",
                          "--prompt_len", "4", "--new_tokens", "4"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ratio ours/torch training" in out.stdout and "ratio ours/torch generation" in out.stdout
    assert out.stdout.count("its own process, GLIBC_TUNABLES=") == 2


@pytest.mark.torch
def test_the_torch_peer_makes_every_tensor_on_its_models_device(small_gpt_config):
    """On a GPU the peer's tensors must be made there (a CPU arange crashed it): the model on `meta`, its
    training forward and backward, the prefill and the decoding steps make no tensor anywhere else."""
    torch = pytest.importorskip("torch")
    from torch.overrides import TorchFunctionMode

    from transformer import models
    from transformer.bench import torch_gpt
    config = small_gpt_config()

    class Made(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.devices = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.arange, torch.zeros, torch.ones, torch.full, torch.tensor, torch.empty):
                self.devices.add(out.device.type)
            return out

    model = torch_gpt.build(config, models.count_params(config.model)).to("meta")
    tokens = torch.zeros((2, 9), dtype=torch.long, device="meta")
    decoder = torch_gpt.Decoder(model, compile_model=False)
    heads, d = model.transformer.h[0].attn.heads, config.model.d_model
    caches = [(torch.empty((2, heads, 16, d // heads), device="meta"),) * 2 for _ in model.transformer.h]
    with Made() as made:
        torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        token = decoder._prefill(tokens[:, :4], caches)
        decoder._step(token, caches, torch.tensor(4, device="meta"))
    assert made.devices == {"meta"}, made.devices


def test_a_bench_tokenizes_a_corpus_once_for_every_later_run(small_gpt_config, tmp_path, monkeypatch):
    """The time to a bench's first step is its compile's: the text is tokenized into a shared cache once."""
    monkeypatch.setenv("TRANSFORMER_CACHE", str(tmp_path))
    config = small_gpt_config()
    cached = measure.cached_text(config, "lm")
    assert cached.data.source.startswith(str(tmp_path / "stores")) and config.data.source == "stdlib"
    index = os.path.join(cached.data.source, "index.json")
    written = os.path.getmtime(index)
    assert measure.cached_text(config, "lm").data.source == cached.data.source
    assert os.path.getmtime(index) == written
    assert measure.cached_text(config, "image_classification") is config
