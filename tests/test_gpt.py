"""The GPT family: pinned sizes, causality, kv-cache decoding, config errors, the generate command."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAST_COMPILES, REPO

from transformer import config as config_lib
from transformer import models, rundir
from transformer.data.text import tokenizers
from transformer.inference import decoding, engine, sampling
from transformer.models import flops, gpt

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
    # ImageGPT's paper: iGPT-S 76M, iGPT-M 455M, iGPT-L 1.4B, iGPT-XL 6.8B (513 ids: 512 colours + [SOS])
    "igpt-tiny": 805_888,
    "igpt-s": 76_707_840,
    "igpt-m": 455_565_312,
    "igpt-l": 1_363_064_832,
    "igpt-xl": 6_812_909_568,
    "llama-tiny": 1_722_048,
    "llama3-8b": 8_030_261_248,  # Meta-Llama-3-8B
    "llama3-70b": 70_553_706_496,  # Meta-Llama-3-70B
    "mistral-7b": 7_241_732_096,  # Mistral-7B-v0.1
    # Qwen3's model cards: 0.6B (0.44B less the embedding), 1.7B (1.4B), 4.0B (3.6B), 8.2B (6.95B)
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    # 32 x (attention 41,943,040 + 8 experts x 3 x 4096 x 14336 + router 4096 x 8 + norms) + 2 x 32000 x 4096 +
    # 4096: Mixtral-8x7B-v0.1's published 46,702,792,704
    "mixtral-8x7b": 46_702_792_704,
    # 48 x (attention 18,874,368 + q/k norms 256 + 128 experts x 3 x 2048 x 768 + router 2048 x 128 + norms 4096)
    # + 2 x 151936 x 2048 + 2048: Qwen3-30B-A3B's card says 30.5B
    "qwen3-30b-a3b": 30_532_122_624,
    # transformers' BloomForCausalLM of each bigscience/bloom-* config (counted on the meta device)
    "bloom-560m": 559_214_592,
    "bloom-1b1": 1_065_314_304,
    "bloom-1b7": 1_722_408_960,
    "bloom-3b": 3_002_557_440,
    "bloom-7b1": 7_069_016_064,
    "bloom-176b": 176_247_271_424,
}
# Parameters one token uses (k of the E experts; the embedding and output included), from the same sums with
# k / E of the experts: Mixtral's card says 12.9B, Qwen3-30B-A3B's 3.3B.
PINNED_ACTIVE = {"mixtral-8x7b": 12_879_925_248, "qwen3-30b-a3b": 3_353_032_704}


@pytest.mark.parametrize("preset", sorted(gpt.PRESETS))
def test_pinned_parameter_counts(preset):
    assert preset in PINNED, f"preset {preset!r} has no pinned parameter count"
    assert models.count_params(gpt.default_model_config(preset)) == PINNED[preset]


@pytest.mark.parametrize("preset", sorted(PINNED_ACTIVE))
def test_pinned_active_parameter_counts_of_the_mixtures(preset):
    vocab = gpt.default_model_config(preset)["vocab_size"]  # the published model's (a run's comes from its data)
    config = config_lib.load(os.path.join(REPO, f"configs/gpt.py:{preset}"), [f"model.vocab_size={vocab}"])
    assert flops.forward_flops(config)["active"] == PINNED_ACTIVE[preset]


def small_model(**overrides):
    cfg = gpt.default_model_config("tiny")
    cfg.update(num_layers=2, d_model=32, num_heads=4, mlp_dim=64, max_len=24, vocab_size=50)
    cfg.update(overrides)
    return gpt.build(cfg)


MODELS = {
    "learned": {},
    "rotary-gqa-swiglu-rms": dict(positions="rotary", num_kv_heads=2, activation="swiglu", norm="rmsnorm"),
    "sinusoidal-untied-mqa": dict(positions="sinusoidal", tie_embeddings=False, num_kv_heads=1),
    "qwen3-qk-norm-softcap": dict(positions="rotary", num_kv_heads=2, activation="swiglu", norm="rmsnorm",
                                  head_dim=16, qk_norm=True, logit_softcap=0.1),
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
    full = jax.jit(model.apply)({"params": params}, tokens)
    fed = jax.jit(lambda cache, t: model.apply({"params": params, "cache": cache}, t, decode=True,
                                               mutable=["cache"]))  # a program for the prompt, one per step
    logits, variables = fed(decoding.init_cache(model, 2), tokens[:, :7])
    steps = [logits]
    for t in range(7, 20):
        logits, variables = fed(variables["cache"], tokens[:, t:t + 1])
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=1e-5)


def test_greedy_generation_equals_argmax_of_full_forward():
    model = small_model(positions="rotary")
    prompt = jax.random.randint(jax.random.key(3), (2, 4), 0, 50)
    params = nn.unbox(model.init(jax.random.key(0), prompt)["params"])
    new = np.array(engine.new_tokens(model, params, prompt.tolist(), sampling.Sampling(max_new_tokens=12)))
    logits = model.apply({"params": params}, jnp.concatenate([prompt, new], 1))  # [B, 16, V]
    np.testing.assert_array_equal(np.asarray(new), np.asarray(jnp.argmax(logits[:, 3:-1], -1)))


def test_sampling_respects_top_k_and_top_p():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    def draws(temperature, top_k=0, top_p=1.0):
        row = lambda v, dtype: jnp.full((1,), v, dtype)  # noqa: E731
        keys = jax.vmap(jax.random.key)(jnp.arange(200))[:, None]  # [200, 1]: 200 draws of one row
        tokens, _ = jax.jit(jax.vmap(lambda k: sampling.draw(logits, k, row(temperature, jnp.float32),
                                                             row(top_k, jnp.int32), row(top_p, jnp.float32))))(keys)
        return set(np.asarray(tokens).ravel().tolist())
    assert draws(temperature=1.0, top_k=2) == {0, 1}
    assert draws(temperature=1.0, top_p=0.7) == {0, 1}
    assert draws(temperature=1.0) == {0, 1, 2, 3}
    assert draws(temperature=0.0) == {0}


@pytest.mark.parametrize("overrides,match", [
    (dict(d_model=30), "config.model.d_model=30 is not divisible by num_heads=4"),
    (dict(num_kv_heads=3), "config.model.num_heads=4 is not a multiple of num_kv_heads=3"),
    (dict(positions="spiral"), "config.model.positions='spiral'"),
    (dict(bogus=1), "unknown config.model keys for the gpt family: bogus"),
    (dict(logit_softcap=-1.0), r"config.model.logit_softcap=-1.0 must be >= 0 \(0: none\)"),
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

    long = engine.complete(model, params, Ids(), "1 2 3", sampling.Sampling(max_new_tokens=40))[0].split()
    short = engine.complete(model, params, Ids(), "1 2 3", sampling.Sampling(max_new_tokens=13))[0].split()
    assert len(long) == 40 and long[:13] == short
    window = [int(t) for t in long[5:13]]  # the second window starts from the last 8 tokens
    after = engine.new_tokens(model, params, [window], sampling.Sampling(max_new_tokens=8))
    assert [int(t) for t in after[0]] == [int(t) for t in long[13:21]]


def test_generation_stops_at_the_stop_id_and_a_completion_ends_before_it():
    model = small_model(max_len=16)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    prompt = jnp.array([[1, 2, 3], [4, 5, 6]])
    free = np.array(engine.new_tokens(model, params, prompt.tolist(), sampling.Sampling(max_new_tokens=10)))
    stop = int(free[0, 4])  # row 0 draws it at its fifth token (or sooner)
    stopped = engine.new_tokens(model, params, prompt.tolist(), sampling.Sampling(max_new_tokens=10, stop_ids=(stop,)))
    for row, out in zip(free, stopped):
        end = list(row).index(stop) + 1 if stop in row else len(row)
        np.testing.assert_array_equal(out, row[:end])  # a row ends with its stop id

    class Ids:
        def encode(self, text):
            return np.array([int(t) for t in text.split()], np.int32)

        def decode(self, ids):
            return " ".join(str(int(i)) for i in ids)

    text = engine.complete(model, params, Ids(), "1 2 3", sampling.Sampling(max_new_tokens=40, stop_ids=(stop,)))[0]
    text = text.split()
    assert [int(t) for t in text] == list(free[0, :list(free[0]).index(stop)])


def test_greedy_is_argmax_with_ties_and_infinities():
    logits = jnp.asarray([[0.0, 3.0, 3.0, 1.0], [-jnp.inf, -1.0, -jnp.inf, -1.0], [jnp.inf, 0.0, jnp.inf, 2.0]])
    np.testing.assert_array_equal(sampling.greedy(logits), jnp.argmax(logits, -1))
    random = jnp.asarray(np.random.default_rng(0).normal(size=(8, 1000)), jnp.float32)
    np.testing.assert_array_equal(sampling.greedy(random), jnp.argmax(random, -1))


def end_of_document_run(workdir, tokenizer=None) -> None:
    """A GPT run whose greedy next id is always 0xFF, the byte tokenizer's end of document (`tokenizer`,
    bytes by default): its final norm makes every position the vector of ones (scale 0, bias 1), which
    its own unembedding reads as 0xFF alone."""
    config = config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny"), [
        "model.num_layers=1", "model.d_model=16", "model.num_heads=2", "model.mlp_dim=32", "model.max_len=32",
        "model.tie_embeddings=False", "model.vocab_size=256"])
    model = models.build(config.model)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    params["final_norm"] = {"scale": jnp.zeros(16), "bias": jnp.ones(16)}
    params["unembed"]["kernel"] = jnp.zeros((16, 256)).at[:, 0xFF].set(1.0)
    run = rundir.RunDir(str(workdir))
    run.write_config(config)
    (tokenizer or tokenizers.ByteTokenizer()).save(str(workdir))
    ckpt = run.checkpointer()
    ckpt.save_params(params)
    ckpt.wait()
    ckpt.close()


def generate_cli(workdir, *args):
    return subprocess.run([sys.executable, "-m", "transformer.generate", "--workdir", str(workdir), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "XLA_FLAGS": FAST_COMPILES})


def test_generate_stops_at_the_end_of_document_unless_told_to_ignore_it(tmp_path):
    end_of_document_run(tmp_path)
    stopped = generate_cli(tmp_path, "--prompt", "def ", "--temperature", "0", "--max_new_tokens", "6")
    assert stopped.returncode == 0 and stopped.stdout == "def \n", stopped.stderr[-2000:]
    past = generate_cli(tmp_path, "--prompt", "def ", "--temperature", "0", "--max_new_tokens", "6", "--ignore_eos")
    assert past.returncode == 0 and past.stdout == "def " + "\ufffd" * 6 + "\n", past.stderr[-2000:]


def test_generate_at_a_step_the_run_has_no_checkpoint_of_names_its_steps(tmp_path):
    end_of_document_run(tmp_path)
    refused = generate_cli(tmp_path, "--prompt", "def ", "--step", "7")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: --step=7: {tmp_path} holds checkpoints of steps 0"], refused.stderr[-2000:]


def test_generate_without_an_end_of_text_token_names_ignore_eos(tmp_path):
    import tokenizers as hf_tokenizers

    vocab = {chr(0x100 + i): i for i in range(256)}
    inner = hf_tokenizers.Tokenizer(hf_tokenizers.models.WordLevel(vocab, unk_token=chr(0x100)))
    end_of_document_run(tmp_path, tokenizers.HFTokenizer(inner, "hf"))
    refused = generate_cli(tmp_path, "--prompt", "\u0141", "--temperature", "0", "--max_new_tokens", "3")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: the 'hf' tokenizer has no end-of-text token (none of [EOS], <|endoftext|>, </s>, [SEP]) to stop "
        "a completion at: pass --ignore_eos to write all --max_new_tokens"], refused.stderr[-2000:]
    past = generate_cli(tmp_path, "--prompt", "\u0141", "--temperature", "0", "--max_new_tokens", "3", "--ignore_eos")
    words = past.stdout.replace(" ", "")  # a word-level tokenizer decodes its tokens with spaces between
    assert past.returncode == 0 and words == "\u0141" + chr(0x1FF) * 3 + "\n", past.stderr[-2000:]


@pytest.mark.parametrize("family,args", [
    ("encdec", ["--input", "x", "--num_samples", "2"]),
    ("encdec", ["--input", "x", "--temperature", "0.5"]),
    ("encdec", ["--input", "x", "--top_k", "5"]),
    ("encdec", ["--input", "x", "--ignore_eos"]),
    ("gpt", ["--prompt", "x", "--beam_size", "4"]),
    ("gpt", ["--prompt", "x", "--input", "y"]),
])
def test_generate_refuses_a_flag_the_family_does_not_read_in_one_line(tmp_path, family, args):
    (tmp_path / "config.json").write_text(json.dumps({"model": {"family": family}}))
    out = generate_cli(tmp_path, *args)
    flag = next(a for a in args[2:] if a.startswith("--"))
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: {flag} does not apply to {family} models, which "
        f"{'translate an --input TEXT' if family == 'encdec' else 'continue a --prompt TEXT'}: drop it"], out.stderr
