"""The key/value cache and the cached decode step of a causal model (`step`), the engine's programs over its
slots (`prefill_rows`, `place_rows`, `decode_slots`) and the params' layout on several devices
(`decoding_layout`), and an encoder-decoder's own greedy and beam search (`greedy_decode`, `beam_search`,
`translate`). The command is `python -m transformer.generate`.

Glossary of shapes: B batch, L new tokens of a step, N new tokens, V vocab, S source length (the engine's:
slots), R prefilled rows, T steps of one decode call, D model width, W beam width.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer import parallel
from transformer.data.text import seq2seq_pairs, tokenizers
from transformer.inference import sampling
from transformer.models import common


def init_cache(model: nn.Module, batch_size: int):
    """An empty cache (zeros, index 0) for `batch_size` sequences of up to model.max_len."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes(model, batch_size))


@functools.lru_cache(maxsize=64)
def cache_shapes(model: nn.Module, batch_size: int):
    """The shapes and dtypes of `model`'s cache for `batch_size` sequences (traced once per model and size)."""
    dummy = jnp.zeros((batch_size, 1), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), dummy, decode=True))["cache"]


def sized_cache(model: nn.Module, positions: int) -> nn.Module:
    """`model` with a decode cache of `positions` rounded up to 64 (at most max_len): every
    decode step reads the whole cache, so one of max_len would cost a long context per token."""
    return model.clone(cache_length=min(model.max_len, -(-positions // 64) * 64))


def step(model: nn.Module, params, cache, tokens: jax.Array) -> tuple[jax.Array, dict]:
    """The cached decode step of a causal model: tokens [B, L] continue the sequences the cache holds
    (L > 1: a prefill) -> (the last position's logits [B, V], the cache)."""
    logits, variables = model.apply({"params": params, "cache": cache}, tokens, decode=True, last_only=True,
                                    mutable=["cache"])
    return logits[:, -1], variables["cache"]


def decoding_layout(run, devices, room: float = 0.5) -> tuple:
    """(the mesh an engine of `run` (a rundir.RunDir) decodes on over `devices`, its params' layout in words):
    every device a data-parallel replica holding the whole params where they take at most `room` of one
    device's memory (however the run trained: an FSDP layout would gather every weight at every token), else
    the run's own config.mesh (its fsdp and tensor axes)."""
    boxed = jax.eval_shape(lambda: run.model().init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(boxed))
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    if limit is None or size <= room * limit:
        return parallel.make_mesh({"data": -1}, devices), f"the params replicated on each ({size / 2**30:.2f} GiB)"
    mesh = parallel.make_mesh(run.config.mesh, devices)
    return mesh, (f"the params in the run's layout ({', '.join(f'{k}={v}' for k, v in mesh.shape.items() if v > 1)}: "
                  f"{size / 2**30:.2f} GiB is more than {room:.0%} of a device's {limit / 2**30:.1f} GiB)")


COUNTERS = ("cache_index", "position")  # a cache's positions: attention's and the learned embeddings'
PACKABLE = {"cached_key", "cached_value", *COUNTERS}  # a cache whose rows may be prefilled padded (no ring)


def leaf_name(path) -> str:
    return path[-1].key


@functools.partial(jax.jit, static_argnames=("rows",))
def empty_rows(one, rows: int):
    """`rows` zeroed copies [R, ...] of a batch-1 cache."""
    return jax.tree.map(lambda x: jnp.zeros((rows,) + x.shape, x.dtype), one)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def prefill_rows(model, params, cache, tokens):
    """R batch-1 caches [R, ...] continued by tokens [R, L], each row its own."""
    return jax.vmap(lambda c, t: step(model, params, c, t[None])[1])(cache, tokens)


@functools.partial(jax.jit, donate_argnames=("cache",))
def place_rows(cache, rows, lengths, slot, source):
    """The slots' cache [S, ...] with row source[i] of `rows` [R, ...] copied into slot[i] (a slot past S is
    no copy), each row's position counters set to its prefilled length, lengths [R]."""
    def put(path, c, x):
        if leaf_name(path) in COUNTERS:
            x = jnp.broadcast_to(lengths.reshape((-1,) + (1,) * (x.ndim - 1)), x.shape).astype(x.dtype)
        return c.at[slot].set(x[source], mode="drop")
    return jax.tree_util.tree_map_with_path(put, cache, rows)


@functools.partial(jax.jit, static_argnames=("model", "steps"), donate_argnames=("cache",))
def decode_slots(model, params, cache, rows: dict, steps: int):
    """Up to `steps` cached steps of every slot, fewer where every row stops before -> (cache, tokens [S, T]
    (-1 where a row had stopped or no step ran), their log-probabilities [S, T], the rows' state after them)."""
    def one(carry):
        t, cache, token, count, done, tokens, logps = carry
        logits, cache = jax.vmap(lambda c, x: step(model, params, c, x[None, None]))(cache, token)
        keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(rows["key"]), count)
        new, logp = sampling.draw(logits[:, 0], keys, rows["temperature"], rows["top_k"], rows["top_p"])
        live = ~done
        count = count + live
        done = done | (live & ((new[:, None] == rows["stops"]).any(1) | (count >= rows["budget"])))
        tokens, logps = tokens.at[:, t].set(jnp.where(live, new, -1)), logps.at[:, t].set(logp)
        return t + 1, cache, jnp.where(live, new, token), count, done, tokens, logps

    slots = rows["token"].shape[0]
    carry = (0, cache, rows["token"], rows["count"], rows["done"], jnp.full((slots, steps), -1, jnp.int32),
             jnp.zeros((slots, steps), jnp.float32))
    _, cache, token, count, done, tokens, logps = jax.lax.while_loop(
        lambda c: (c[0] < steps) & ~c[4].all(), one, carry)
    return cache, tokens, logps, {"token": token, "count": count, "done": done}


PAD_TO = 16  # a packed prefill pads its rows to a multiple of this: a 15-token prompt is one chunk, not four


def chunks(n: int, room: int | None = None) -> list[int]:
    """The lengths a prompt of n tokens is prefilled in: powers of two, largest first, summing to n, or, given
    the cache's `room`, to n rounded up to a multiple of PAD_TO where that fits (padding past a row's length is
    hidden by the causal mask until decoding overwrites it)."""
    if room is not None and -(-n // PAD_TO) * PAD_TO <= room:
        n = -(-n // PAD_TO) * PAD_TO
    return [1 << b for b in reversed(range(n.bit_length())) if n >> b & 1]


def length_penalty(length, alpha: float):
    """GNMT's ((5 + length) / 6) ** alpha; a sequence's score is its log-probability divided by it."""
    return ((5.0 + length) / 6.0) ** alpha


def decode_step(model: nn.Module, params, cache, tokens: jax.Array, encoded: jax.Array, src_valid: jax.Array):
    """tokens [B] -> (next-token logits [B, V], cache); cache None starts a new one (and projects encoded)."""
    variables = {"params": params} if cache is None else {"params": params, "cache": cache}
    logits, mutated = model.apply(variables, tokens[:, None], encoded, src_valid, decode=True,
                                  mutable=["cache"], method="decode")
    return logits[:, -1], mutated["cache"]


@functools.partial(jax.jit, static_argnames=("model", "max_len", "bos_id", "eos_id", "alpha"))
def greedy_decode(model: nn.Module, params, src: jax.Array, src_valid: jax.Array, *, max_len: int,
                  bos_id: int, eos_id: int, alpha: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """src [B, S] -> (tokens [B, N] ending at [EOS], then [PAD]; scores [B]), N = max_len.

    The source is encoded once; each step feeds one token through the cached decoder,
    and the loop stops when every row has its [EOS].
    """
    model = sized_cache(model, max_len + 1)
    with common.not_sowing():
        encoded = model.apply({"params": params}, src, src_valid, method="encode")  # [B, S, D]
    b = src.shape[0]
    logits, cache = decode_step(model, params, None, jnp.full((b,), bos_id, jnp.int32), encoded, src_valid)
    init = (0, logits, cache, jnp.zeros((b, max_len), jnp.int32), jnp.zeros(b, bool), jnp.zeros(b), jnp.zeros(b))

    def body(carry):
        i, logits, cache, tokens, done, logp_sum, length = carry
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))  # [B, V]
        token = jnp.where(done, 0, sampling.greedy(logp))
        logp_sum = logp_sum + jnp.where(done, 0.0, jnp.take_along_axis(logp, token[:, None], 1)[:, 0])
        length = length + ~done
        done = done | (token == eos_id)
        logits, cache = decode_step(model, params, cache, token, encoded, src_valid)
        return i + 1, logits, cache, tokens.at[:, i].set(token), done, logp_sum, length

    cond = lambda carry: (carry[0] < max_len) & ~jnp.all(carry[4])
    _, _, _, tokens, _, logp_sum, length = jax.lax.while_loop(cond, body, init)
    return tokens, logp_sum / length_penalty(length, alpha)


def _gather_beams(tree, parents: jax.Array):
    """Rows [B * W, ...] of every cache array reordered by parent beams [B, W].

    Cross-attention keys/values (the same for every beam of a row) and counters stay as they are.
    """
    b, w = parents.shape

    def gather(path, x):
        if x.ndim == 0 or path[-1].key in ("source_key", "source_value"):
            return x
        x = x.reshape(b, w, *x.shape[1:])  # [B, W, ...]
        index = parents.reshape(b, w, *([1] * (x.ndim - 2)))
        return jnp.take_along_axis(x, index, axis=1).reshape(b * w, *x.shape[2:])

    return jax.tree_util.tree_map_with_path(gather, tree)


@functools.partial(jax.jit, static_argnames=("model", "max_len", "bos_id", "eos_id", "beam_size", "alpha"))
def beam_search(model: nn.Module, params, src: jax.Array, src_valid: jax.Array, *, max_len: int, bos_id: int,
                eos_id: int, beam_size: int = 4, alpha: float = 0.6) -> tuple[jax.Array, jax.Array]:
    """src [B, S] -> (best tokens [B, N] ending at [EOS], then [PAD]; their scores [B]).

    Scores are log-probabilities divided by `length_penalty(length, alpha)`. Each step
    extends the W alive beams by their 2W best tokens: those ending in [EOS] join the
    finished set, the W best others stay alive. The loop stops when no alive beam can
    beat the best finished one (alpha >= 0) or at max_len.
    """
    b, w, n = src.shape[0], beam_size, max_len
    model = sized_cache(model, max_len + 1)
    with common.not_sowing():
        encoded = model.apply({"params": params}, src, src_valid, method="encode")  # [B, S, D]
    encoded, src_valid = jnp.repeat(encoded, w, axis=0), jnp.repeat(src_valid, w, axis=0)  # [B * W, S, ...]
    logits, cache = decode_step(model, params, None, jnp.full((b * w,), bos_id, jnp.int32), encoded, src_valid)
    alive_logp = jnp.tile(jnp.array([0.0] + [-jnp.inf] * (w - 1)), (b, 1))  # [B, W]
    seqs = jnp.zeros((b, w, n), jnp.int32)
    init = (0, logits, cache, seqs, alive_logp, seqs, jnp.full((b, w), -jnp.inf))

    def body(carry):
        i, logits, cache, alive, alive_logp, fin, fin_scores = carry
        logp = jax.nn.log_softmax(logits.astype(jnp.float32)).reshape(b, w, -1)  # [B, W, V]
        cand_logp, index = jax.lax.top_k((alive_logp[..., None] + logp).reshape(b, -1), 2 * w)  # [B, 2W]
        parent, token = index // logp.shape[-1], (index % logp.shape[-1]).astype(jnp.int32)
        cand = jnp.take_along_axis(alive, parent[..., None], axis=1).at[:, :, i].set(token)  # [B, 2W, N]
        is_eos = token == eos_id
        fin_scores, keep = jax.lax.top_k(jnp.concatenate(
            [fin_scores, jnp.where(is_eos, cand_logp / length_penalty(i + 1, alpha), -jnp.inf)], 1), w)
        fin = jnp.take_along_axis(jnp.concatenate([fin, cand], 1), keep[..., None], axis=1)  # [B, W, N]
        alive_logp, keep = jax.lax.top_k(jnp.where(is_eos, -jnp.inf, cand_logp), w)  # [B, W]
        alive = jnp.take_along_axis(cand, keep[..., None], axis=1)
        cache = _gather_beams(cache, jnp.take_along_axis(parent, keep, 1))
        token = jnp.take_along_axis(token, keep, 1).reshape(-1)  # [B * W]
        logits, cache = decode_step(model, params, cache, token, encoded, src_valid)
        return i + 1, logits, cache, alive, alive_logp, fin, fin_scores

    def cond(carry):
        i, alive_logp, fin_scores = carry[0], carry[4], carry[6]
        hopeless = alive_logp[:, 0] / length_penalty(n, alpha) < fin_scores[:, 0]
        return (i < n) & ~jnp.all(hopeless)

    i, _, _, alive, alive_logp, fin, fin_scores = jax.lax.while_loop(cond, body, init)
    scores = jnp.concatenate([fin_scores, alive_logp / length_penalty(i, alpha)], 1)  # [B, 2W]
    best = jnp.argmax(scores, axis=1)
    tokens = jnp.take_along_axis(jnp.concatenate([fin, alive], 1), best[:, None, None], axis=1)[:, 0]
    return tokens, jnp.take_along_axis(scores, best[:, None], 1)[:, 0]


def translate(model, params, tokenizer, texts: list[str], *, max_len: int, source_len: int | None = None,
              beam_size: int = 1, alpha: float = 0.0, source_eos: bool = False) -> list[str]:
    """Source texts (cut to `source_len` tokens, ending in [EOS] with `source_eos`) -> target texts of at
    most `max_len` tokens of an encoder-decoder: greedy (beam_size 1) or beam search."""
    bos, eos = (tokenizers.require_special(tokenizer, name) for name in ("[BOS]", "[EOS]"))
    source_len = source_len or model.max_len
    encoded = [seq2seq_pairs.source_ids(tokenizer, t, source_len, source_eos) for t in texts]
    if not all(len(ids) for ids in encoded):
        raise ValueError("an input encodes to no tokens; give a non-empty --input")
    src = jnp.asarray(seq2seq_pairs.pad_batch(encoded, min(source_len, max(len(ids) for ids in encoded))))
    max_len = min(max_len, model.max_len)
    if beam_size > 1:
        tokens, _ = beam_search(model, params, src, src != 0, max_len=max_len, bos_id=bos, eos_id=eos,
                                beam_size=beam_size, alpha=alpha)
    else:
        tokens, _ = greedy_decode(model, params, src, src != 0, max_len=max_len, bos_id=bos, eos_id=eos,
                                  alpha=alpha)
    return [tokenizer.decode(sampling.until_stop(row, (eos,))) for row in np.asarray(tokens)]
