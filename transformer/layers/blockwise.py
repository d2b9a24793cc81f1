"""Blockwise attention: an online softmax over the blocks a mask leaves visible, memory O(L x block).

Glossary of shapes: B batch, L queries, S keys, K kv heads, G = H // K query heads per kv head,
Dh head width, bq x bk one block (of queries x keys), Lp and Sp the lengths padded to blocks.

The visible (query block, key block) pairs come from the mask's static parts
(`Mask.visible_blocks`), so a causal mask computes about half the blocks and a window W
about L x W scores. One scan over the pairs carries the running max, sum and output of
every query (the flash-attention recurrence); the backward pass recomputes each block's
probabilities from the saved log-sum-exp instead of storing them. Grouped kv heads are never
repeated: the G query heads of a kv head share its block. A query that may see no key gets
output 0 and gradient 0.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from transformer.layers.masks import FAR, Mask


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static part of one call: block sizes, true lengths, the visible pairs and the bias function."""

    bq: int
    bk: int
    length: int
    source_length: int
    pairs: tuple[tuple[int, ...], tuple[int, ...]]  # query block indices, key block indices
    bias_fn: object = None


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, block: int = 512) -> jax.Array:
    """softmax(q k^T / sqrt(Dh) + bias) v over the allowed pairs: q [B, L, H, Dh], k, v [B, S, K, Dh]
    -> [B, L, H, Dh] in q's dtype, with the scores and softmax in float32."""
    b, length, h, dh = q.shape
    source_length, kv_heads = k.shape[1], k.shape[2]
    bq, bk = min(block, length), min(block, source_length)
    qi, kj = np.nonzero(mask.visible_blocks(length, source_length, bq, bk))
    if not len(qi):
        return jnp.zeros_like(q)
    lp, sp = -(-length // bq) * bq, -(-source_length // bk) * bk
    q_pos, k_pos = mask.positions(length, source_length)
    plan = _Plan(bq, bk, length, source_length, (tuple(qi.tolist()), tuple(kj.tolist())),
                 None if mask.bias is None else mask.bias.fn)
    arrays = _padded_arrays(mask, lp, sp)
    q = _pad(q * jnp.asarray(dh**-0.5, q.dtype), lp).reshape(b, lp, kv_heads, h // kv_heads, dh)  # [B, Lp, K, G, Dh]
    out = _attention(plan, q, _pad(k, sp), _pad(v, sp), None if mask.bias is None else mask.bias.params, arrays,
                     _pad(jnp.broadcast_to(q_pos, (length,)), lp), _pad(jnp.broadcast_to(k_pos, (source_length,)),
                                                                         sp, FAR))
    return out[:, :length].reshape(b, length, h, dh)


def _pad(x: jax.Array, size: int, value=0) -> jax.Array:
    """x padded along axis 1 (axis 0 for a 1-d array) to `size`."""
    axis = 0 if x.ndim == 1 else 1
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _padded_arrays(mask: Mask, lp: int, sp: int) -> Mask:
    """The mask's arrays padded to the blocks (padding keys are dropped by `key_in` anyway); positions
    and the bias travel separately."""
    key_segments = mask.segments if mask.key_segments is None and mask.segments is not None else mask.key_segments
    return mask.replace(
        key_valid=None if mask.key_valid is None else _pad(mask.key_valid, sp, False),
        segments=None if mask.segments is None else _pad(mask.segments, lp, -1),
        key_segments=None if key_segments is None else _pad(key_segments, sp, -2),
        query_positions=None, key_positions=None, bias=None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plan, q, k, v, bias_params, arrays, q_pos, k_pos):
    return _forward(plan, q, k, v, bias_params, arrays, q_pos, k_pos)[0]


def _scores(plan: _Plan, i, j, q, k, bias_params, arrays: Mask, q_pos, k_pos):
    """Block (i, j)'s masked scores [B, K, G, bq, bk] float32 (-inf where not allowed) and its q, k slices."""
    qb = jax.lax.dynamic_slice_in_dim(q, i * plan.bq, plan.bq, 1)  # [B, bq, K, G, Dh]
    kb = jax.lax.dynamic_slice_in_dim(k, j * plan.bk, plan.bk, 1)  # [B, bk, K, Dh]
    qp = jax.lax.dynamic_slice_in_dim(q_pos, i * plan.bq, plan.bq)  # [bq]
    kp = jax.lax.dynamic_slice_in_dim(k_pos, j * plan.bk, plan.bk)  # [bk]
    s = jnp.einsum("bqkgd,bskd->bkgqs", qb, kb, preferred_element_type=jnp.float32)  # [B, K, G, bq, bk]
    if plan.bias_fn is not None:
        s = s + plan.bias_fn(bias_params, qp, kp).astype(jnp.float32).reshape(s.shape[1:])
    key_in = j * plan.bk + jnp.arange(plan.bk) < plan.source_length
    allowed = arrays.block(qp, kp, plan.source_length, ((i * plan.bq, plan.bq), (j * plan.bk, plan.bk)), key_in)
    return jnp.where(allowed[:, None, None], s, -jnp.inf), qb, kb, qp, kp


def _forward(plan: _Plan, q, k, v, bias_params, arrays, q_pos, k_pos):
    """The online softmax over the visible pairs -> out [B, Lp, K, G, Dh] and the residuals."""
    b, lp, kv_heads, g, dh = q.shape
    stats = jnp.full((b, kv_heads, g, lp), -jnp.inf, jnp.float32)  # [B, K, G, Lp]

    def step(carry, pair):
        acc, m, total = carry
        i, j = pair
        s, *_ = _scores(plan, i, j, q, k, bias_params, arrays, q_pos, k_pos)
        vb = jax.lax.dynamic_slice_in_dim(v, j * plan.bk, plan.bk, 1)  # [B, bk, K, Dh]
        m_old = jax.lax.dynamic_slice_in_dim(m, i * plan.bq, plan.bq, 3)  # [B, K, G, bq]
        m_new = jnp.maximum(m_old, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])  # [B, K, G, bq, bk]
        scale = jnp.exp(m_old - m_safe)  # [B, K, G, bq]
        t = jax.lax.dynamic_slice_in_dim(total, i * plan.bq, plan.bq, 3) * scale + p.sum(-1)
        a = jax.lax.dynamic_slice_in_dim(acc, i * plan.bq, plan.bq, 1)  # [B, bq, K, G, Dh]
        a = a * jnp.moveaxis(scale, 3, 1)[..., None] + jnp.einsum(
            "bkgqs,bskd->bqkgd", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
        return (jax.lax.dynamic_update_slice_in_dim(acc, a, i * plan.bq, 1),
                jax.lax.dynamic_update_slice_in_dim(m, m_new, i * plan.bq, 3),
                jax.lax.dynamic_update_slice_in_dim(total, t, i * plan.bq, 3)), None

    pairs = tuple(jnp.asarray(x, jnp.int32) for x in plan.pairs)
    init = (jnp.zeros(q.shape, jnp.float32), stats, jnp.zeros_like(stats))
    (acc, m, total), _ = jax.lax.scan(step, init, pairs)
    seen = total > 0
    out = acc / jnp.moveaxis(jnp.where(seen, total, 1.0), 3, 1)[..., None]  # [B, Lp, K, G, Dh]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)  # +inf: sees nothing, p = 0
    out = out.astype(q.dtype)
    return out, (q, k, v, bias_params, arrays, q_pos, k_pos, out, lse)


def _backward(plan: _Plan, residuals, d_out):
    """Recomputes each visible block's probabilities from the log-sum-exp; accumulates dq, dk, dv, dbias."""
    q, k, v, bias_params, arrays, q_pos, k_pos, out, lse = residuals
    delta = jnp.moveaxis(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1), 1, 3)  # [B, K, G, Lp]

    def step(carry, pair):
        dq, dk, dv, dbias = carry
        i, j = pair
        s, qb, kb, qp, kp = _scores(plan, i, j, q, k, bias_params, arrays, q_pos, k_pos)
        vb = jax.lax.dynamic_slice_in_dim(v, j * plan.bk, plan.bk, 1)  # [B, bk, K, Dh]
        dob = jax.lax.dynamic_slice_in_dim(d_out, i * plan.bq, plan.bq, 1)  # [B, bq, K, G, Dh]
        p = jnp.exp(s - jax.lax.dynamic_slice_in_dim(lse, i * plan.bq, plan.bq, 3)[..., None])  # [B, K, G, bq, bk]
        dp = jnp.einsum("bqkgd,bskd->bkgqs", dob, vb, preferred_element_type=jnp.float32)
        ds = p * (dp - jax.lax.dynamic_slice_in_dim(delta, i * plan.bq, plan.bq, 3)[..., None])
        dvb = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(dob.dtype), dob, preferred_element_type=jnp.float32)
        dkb = jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(qb.dtype), qb, preferred_element_type=jnp.float32)
        dqb = jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(kb.dtype), kb, preferred_element_type=jnp.float32)
        add = lambda x, d, start: jax.lax.dynamic_update_slice_in_dim(
            x, jax.lax.dynamic_slice_in_dim(x, start, d.shape[1], 1) + d, start, 1)
        if plan.bias_fn is not None:
            _, pullback = jax.vjp(lambda p_: plan.bias_fn(p_, qp, kp).astype(jnp.float32), bias_params)
            dbias = jax.tree.map(jnp.add, dbias, pullback(ds.sum(0).reshape(-1, *ds.shape[3:]))[0])
        return (add(dq, dqb, i * plan.bq), add(dk, dkb, j * plan.bk), add(dv, dvb, j * plan.bk), dbias), None

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    init = (zeros(q), zeros(k), zeros(v), jax.tree.map(zeros, bias_params))
    pairs = tuple(jnp.asarray(x, jnp.int32) for x in plan.pairs)
    (dq, dk, dv, dbias), _ = jax.lax.scan(step, init, pairs)
    no_grad = lambda tree: jax.tree.map(lambda x: np.zeros(np.shape(x), jax.dtypes.float0), tree)
    dbias = jax.tree.map(lambda g, x: g.astype(x.dtype), dbias, bias_params)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias, no_grad(arrays),
            no_grad(q_pos), no_grad(k_pos))


_attention.defvjp(_forward, _backward)
