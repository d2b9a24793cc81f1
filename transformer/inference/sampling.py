"""How a next token is drawn: one sampling record, checked in one place, and the per-row sampler every
causal decoder draws with (the engine; `probe` reads its distribution).

    s = Sampling(temperature=0.8, top_k=40, max_new_tokens=64, stop_ids=(0,), stop_strings=("\\n\\n",))

Temperature 0 is greedy (the first largest logit). Otherwise the logits are divided by the temperature, cut
to the top k (0: all) and then to the nucleus of mass top_p (1: all), and a token drawn from what is left.
The log-probability of the drawn token under that distribution comes back with it: at temperature 1 with no
cut it is the policy's own log-probability (what GRPO's ratio needs).

Glossary of shapes: B rows, V vocab.
"""

import dataclasses

import jax
import jax.numpy as jnp

MAX_STOP_STRINGS = 16  # a request's stop strings at most (each is searched for after every new token)


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0          # 0: greedy
    top_k: int = 0                    # keep the k most likely tokens (0: all)
    top_p: float = 1.0                # keep the smallest set with this much mass (1: all)
    seed: int = 0                     # the draws of a request are a function of (seed, sample, position)
    max_new_tokens: int = 16          # new tokens at most (a stop id that ends them included)
    stop_ids: tuple[int, ...] = ()    # a row ends after drawing one of these (it is kept)
    stop_strings: tuple[str, ...] = ()  # a row ends once its text holds one of these (the caller cuts it)

    def __post_init__(self):
        check = [(self.temperature >= 0, f"--temperature={self.temperature} must be >= 0 (0: greedy)"),
                 (self.top_k >= 0, f"--top_k={self.top_k} must be >= 0 (0: all)"),
                 (0 < self.top_p <= 1, f"--top_p={self.top_p} must be in (0, 1] (1: all)"),
                 (self.max_new_tokens >= 1, f"--max_new_tokens={self.max_new_tokens} must be >= 1"),
                 (len(self.stop_strings) <= MAX_STOP_STRINGS,
                  f"{len(self.stop_strings)} stop strings: give at most {MAX_STOP_STRINGS}")]
        for ok, message in check:
            if not ok:
                raise ValueError(message)
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))
        object.__setattr__(self, "stop_strings", tuple(s for s in self.stop_strings if s))


def greedy(logits: jax.Array) -> jax.Array:
    """logits [B, V] -> [B] int32: jnp.argmax's answer (the first largest), as a max and a min, which
    XLA:CPU runs in about half argmax's time."""
    v = logits.shape[-1]
    first = jnp.min(jnp.where(logits == logits.max(-1, keepdims=True), jnp.arange(v), v), -1)
    return jnp.minimum(first, v - 1).astype(jnp.int32)  # NaN logits: an index, not V


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits [B, V] / temperature [B], -inf outside each row's top k [B] and then outside its nucleus of mass
    top_p [B] (temperature > 0; the sort is skipped when no row cuts)."""
    logits = logits.astype(jnp.float32) / temperature[:, None]

    def cut(x):
        ranked = jnp.sort(x, axis=-1)[:, ::-1]  # [B, V], descending
        kept = (jnp.arange(x.shape[-1]) < top_k[:, None]) | (top_k[:, None] == 0)
        ranked = jnp.where(kept, ranked, -jnp.inf)
        kth = jnp.min(jnp.where(kept, ranked, jnp.inf), axis=-1, keepdims=True)  # the smallest kept by top_k
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        nucleus = jnp.min(jnp.where(before < top_p[:, None], ranked, jnp.inf), axis=-1, keepdims=True)
        threshold = jnp.where(top_p[:, None] < 1, jnp.maximum(kth, nucleus), kth)
        return jnp.where(x < threshold, -jnp.inf, x)

    return jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1)), cut, lambda x: x, logits)


def draw(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
         top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Next tokens [B] int32 from logits [B, V], each row with its own key [B] and settings [B], and each
    token's log-probability [B] under the distribution it was drawn from (greedy rows: the softmax's). Where
    every row is greedy no random draw is made (it costs several times the greedy pick)."""
    hot = temperature > 0

    def chosen(x, tokens):
        return tokens, jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), tokens[:, None], axis=-1)[:, 0]

    def sampled(logits):
        logits_f = filtered_logits(logits, jnp.where(hot, temperature, 1.0), jnp.where(hot, top_k, 0),
                                   jnp.where(hot, top_p, 1.0))
        drawn = jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys, logits_f).astype(jnp.int32)
        return chosen(logits_f, jnp.where(hot, drawn, greedy(logits)))

    return jax.lax.cond(jnp.any(hot), sampled, lambda x: chosen(x.astype(jnp.float32), greedy(x)), logits)


def next_token_distribution(logits: jax.Array, temperature: float = 1.0, top_k: int = 0,
                            top_p: float = 1.0) -> jax.Array:
    """The probabilities [B, V] that `draw` samples logits [B, V] from with these settings (one-hot at T = 0)."""
    if temperature == 0:
        return jax.nn.one_hot(greedy(logits), logits.shape[-1])
    b = logits.shape[0]
    full = lambda v, dtype: jnp.full((b,), v, dtype)  # noqa: E731
    return jax.nn.softmax(filtered_logits(logits, full(temperature, jnp.float32), full(top_k, jnp.int32),
                                          full(top_p, jnp.float32)), axis=-1)


def cut_at_stops(text: str, stops) -> tuple[str, bool]:
    """`text` before the first of the stop strings it holds, and whether it held one."""
    at = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


def until_stop(ids, stop_ids) -> list[int]:
    """The ids before the first of `stop_ids` (all of them if none is there)."""
    ids = [int(i) for i in ids]
    return next((ids[:i] for i, t in enumerate(ids) if t in stop_ids), ids)
