"""Sampling from a trained language model with the key/value cache.

  python -m transformer.generate --workdir runs/gpt-tiny --prompt "def " \
      --max_new_tokens 200 --temperature 0.8 --top_k 40 --top_p 0.95 --seed 0

Glossary of shapes: B batch, P prompt length, N new tokens, V vocab.
"""

import functools
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer import checkpoint, config as config_lib, models
from transformer.data import tokenizers


def init_cache(model: nn.Module, batch_size: int):
    """An empty cache (zeros, index 0) for `batch_size` sequences of up to model.max_len."""
    dummy = jnp.zeros((batch_size, 1), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), dummy, decode=True))["cache"]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def sample_logits(logits: jax.Array, rng: jax.Array, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> jax.Array:
    """Next tokens [B] from logits [B, V]: greedy at temperature 0, else top-k / nucleus sampling."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # [B, V], descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        cutoff = jnp.min(jnp.where(before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "temperature", "top_k", "top_p"))
def generate(model: nn.Module, params, prompt: jax.Array, rng: jax.Array, *, max_new_tokens: int,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """prompt [B, P] int32 -> new tokens [B, N]: one prefill, then one cached step per token."""
    sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    logits, variables = model.apply({"params": params, "cache": init_cache(model, prompt.shape[0])},
                                    prompt, decode=True, mutable=["cache"])
    first = sample(logits[:, -1], jax.random.fold_in(rng, 0))  # [B]

    def step(carry, i):
        token, cache = carry
        logits, variables = model.apply({"params": params, "cache": cache}, token[:, None],
                                        decode=True, mutable=["cache"])
        nxt = sample(logits[:, -1], jax.random.fold_in(rng, i))
        return (nxt, variables["cache"]), token

    (last, _), tokens = jax.lax.scan(step, (first, variables["cache"]), jnp.arange(1, max_new_tokens))
    return jnp.concatenate([tokens.T, last[:, None]], axis=1)  # [B, N]


def complete(model, params, tokenizer, prompt: str, max_new_tokens: int, seed: int = 0,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, num_samples: int = 1) -> list[str]:
    """Prompt text -> `num_samples` completions (text only, prompt excluded).

    Longer than the model's context, the text is written in windows: when the cache is
    full, decoding restarts from the last half-context of tokens.
    """
    ids = np.asarray(tokenizer.encode(prompt), np.int32)
    if ids.size == 0:
        raise ValueError("the prompt encodes to no tokens; give a non-empty --prompt")
    seqs = np.tile(ids[-(model.max_len - 1):], (num_samples, 1))  # [B, P]
    new = np.zeros((num_samples, 0), np.int32)  # [B, N so far]
    window = 0
    while new.shape[1] < max_new_tokens:
        context = seqs if window == 0 else np.concatenate([seqs, new], 1)[:, -(model.max_len // 2):]
        n = min(max_new_tokens - new.shape[1], model.max_len - context.shape[1])
        out = generate(model, params, jnp.asarray(context), jax.random.fold_in(jax.random.key(seed), window),
                       max_new_tokens=n, temperature=temperature, top_k=top_k, top_p=top_p)
        new, window = np.concatenate([new, np.asarray(out)], 1), window + 1
    return [tokenizer.decode(row) for row in new]


def load_run(workdir: str, step: int | None = None):
    """(model, params, tokenizer) of a run directory's checkpoint (the latest by default)."""
    config_path = os.path.join(workdir, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} not found: is --workdir a run directory?")
    model = models.build(config_lib.from_json(config_path).model)
    params = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True).restore_params(step)
    return model, params, tokenizers.load_tokenizer(workdir)


def main(argv):
    from absl import flags

    f = flags.FLAGS
    try:
        model, params, tokenizer = load_run(f.workdir, f.step)
        texts = complete(model, params, tokenizer, f.prompt, f.max_new_tokens, f.seed, f.temperature,
                         f.top_k, f.top_p, f.num_samples)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    for i, text in enumerate(texts):
        if f.num_samples > 1:
            print(f"--- sample {i}")
        print(f.prompt + text)


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("workdir", None, "Run directory (holds config.json, checkpoints, tokenizer).")
    flags.DEFINE_string("prompt", "", "Text to continue.")
    flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate.")
    flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 = greedy.")
    flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = all).")
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: keep the smallest set with this much mass.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_integer("num_samples", 1, "Completions to draw.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.mark_flag_as_required("workdir")
    app.run(main, flags_parser=config_lib.parse_flags)
