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
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from transformer.layers.attention.masks import FAR, Mask


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static part of one call: block sizes, true lengths, the visible pairs and the bias function.
    `dynamic`: positions are arrays (a ring's hop, a decode cache), so a block whose positions the
    mask cannot pair is skipped at run time instead."""

    bq: int
    bk: int
    length: int
    source_length: int
    pairs: tuple[tuple[int, ...], tuple[int, ...]]  # query block indices, key block indices
    bias_fn: object = None
    dynamic: bool = False

    def scanned(self) -> tuple[jax.Array, jax.Array]:
        """The pairs as the int32 arrays a scan runs over."""
        return tuple(jnp.asarray(x, jnp.int32) for x in self.pairs)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One call's inputs in the kernel's layout: q [B, Lp, K, G, Dh] (scaled), k, v [B, Sp, K, Dh], the
    mask's arrays padded to the blocks, positions q_pos [Lp], k_pos [Sp] and the bias's parameters."""

    plan: Plan
    q: jax.Array
    k: jax.Array
    v: jax.Array
    bias_params: object
    arrays: Mask
    q_pos: jax.Array
    k_pos: jax.Array


def prepare(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, block: int) -> Prepared | None:
    """q [B, L, H, Dh], k, v [B, S, K, Dh] -> the kernel's inputs (None: the mask leaves no block)."""
    b, length, h, dh = q.shape
    source_length, kv_heads = k.shape[1], k.shape[2]
    bq, bk = min(block, length), min(block, source_length)
    qi, kj = np.nonzero(mask.visible_blocks(length, source_length, bq, bk))
    if not len(qi):
        return None
    lp, sp = -(-length // bq) * bq, -(-source_length // bk) * bk
    q_pos, k_pos = mask.positions(length, source_length)
    plan = Plan(bq, bk, length, source_length, (tuple(qi.tolist()), tuple(kj.tolist())),
                None if mask.bias is None else mask.bias.fn,
                mask.query_positions is not None or mask.key_positions is not None)
    q = _pad(q * jnp.asarray(dh**-0.5, q.dtype), lp).reshape(b, lp, kv_heads, h // kv_heads, dh)  # [B, Lp, K, G, Dh]
    return Prepared(plan, q, _pad(k, sp), _pad(v, sp), None if mask.bias is None else mask.bias.params,
                    _padded_arrays(mask, lp, sp), _pad(jnp.broadcast_to(q_pos, (length,)), lp),
                    _pad(jnp.broadcast_to(k_pos, (source_length,)), sp, FAR))


class Kernel(Protocol):
    """What runs the visible pairs of a `Plan` on `prepare`'s inputs: the scan below (XLA, any
    platform) or a fused kernel (`kernels.pallas_gpu.Flash` on GPUs: `platforms.BLOCKS` chooses); ring attention runs one per hop."""

    def forward(self, plan: Plan, q, k, v, bias_params, arrays: Mask, q_pos, k_pos) -> tuple[jax.Array, jax.Array]:
        """-> out [B, Lp, K, G, Dh] float32 (0 where a query sees nothing), log-sum-exp [B, K, G, Lp] (-inf there)."""

    def backward(self, plan: Plan, q, k, v, bias_params, arrays: Mask, q_pos, k_pos, lse, delta, d_out) -> tuple:
        """-> float32 dq, dk, dv and the bias parameters' gradient (in their dtype), given the log-sum-exp
        of all the keys a query sees and delta = `delta_of(out, d_out)`."""


@dataclasses.dataclass(frozen=True)
class Scan:
    """XLA's scan over the visible pairs (`forward`, `backward` below)."""

    def forward(self, plan, q, k, v, bias_params, arrays, q_pos, k_pos):
        return forward(plan, q, k, v, bias_params, arrays, q_pos, k_pos)

    def backward(self, plan, q, k, v, bias_params, arrays, q_pos, k_pos, lse, delta, d_out):
        return backward(plan, q, k, v, bias_params, arrays, q_pos, k_pos, lse, delta, d_out)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, block: int = 512,
              kernel: Kernel = Scan()) -> jax.Array:
    """softmax(q k^T / sqrt(Dh) + bias) v over the allowed pairs: q [B, L, H, Dh], k, v [B, S, K, Dh]
    -> [B, L, H, Dh] in q's dtype, with the scores and softmax in float32."""
    b, length, h, dh = q.shape
    p = prepare(q, k, v, mask, block)
    if p is None:
        return jnp.zeros_like(q)
    out = _attention(p.plan, kernel, p.q, p.k, p.v, p.bias_params, p.arrays, p.q_pos, p.k_pos)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(plan, kernel, q, k, v, bias_params, arrays, q_pos, k_pos):
    return kernel.forward(plan, q, k, v, bias_params, arrays, q_pos, k_pos)[0].astype(q.dtype)


def _attention_fwd(plan, kernel, q, k, v, bias_params, arrays, q_pos, k_pos):
    out, lse = kernel.forward(plan, q, k, v, bias_params, arrays, q_pos, k_pos)
    out = out.astype(q.dtype)
    return out, (q, k, v, bias_params, arrays, q_pos, k_pos, out, lse)


def _attention_bwd(plan, kernel, residuals, d_out):
    q, k, v, bias_params, arrays, q_pos, k_pos, out, lse = residuals
    dq, dk, dv, dbias = kernel.backward(plan, q, k, v, bias_params, arrays, q_pos, k_pos, lse,
                                        delta_of(out, d_out), d_out)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias, no_grad(arrays),
            no_grad(q_pos), no_grad(k_pos))


_attention.defvjp(_attention_fwd, _attention_bwd)


def no_grad(tree):
    """The (float0) cotangent of integer and boolean inputs."""
    return jax.tree.map(lambda x: np.zeros(np.shape(x), jax.dtypes.float0), tree)


def delta_of(out: jax.Array, d_out: jax.Array) -> jax.Array:
    """rowsum(dO * O) [B, K, G, Lp] float32, the softmax backward's correction: out, d_out [B, Lp, K, G, Dh]."""
    return jnp.moveaxis(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1), 1, 3)


def _slice(x, start, size, axis):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _scores(plan: Plan, i, j, q, k, bias_params, arrays: Mask, q_pos, k_pos):
    """Block (i, j)'s masked scores [B, K, G, bq, bk] float32 (-inf where not allowed) and its q, k slices."""
    qb = _slice(q, i * plan.bq, plan.bq, 1)  # [B, bq, K, G, Dh]
    kb = _slice(k, j * plan.bk, plan.bk, 1)  # [B, bk, K, Dh]
    qp, kp = _slice(q_pos, i * plan.bq, plan.bq, 0), _slice(k_pos, j * plan.bk, plan.bk, 0)  # [bq], [bk]
    s = jnp.einsum("bqkgd,bskd->bkgqs", qb, kb, preferred_element_type=jnp.float32)  # [B, K, G, bq, bk]
    if plan.bias_fn is not None:
        s = s + plan.bias_fn(bias_params, qp, kp).astype(jnp.float32).reshape(s.shape[1:])
    key_in = j * plan.bk + jnp.arange(plan.bk) < plan.source_length
    allowed = arrays.block(qp, kp, plan.source_length, ((i * plan.bq, plan.bq), (j * plan.bk, plan.bk)), key_in)
    return jnp.where(allowed[:, None, None], s, -jnp.inf), qb, kb, qp, kp


def _skipping(plan: Plan, arrays: Mask, q_pos, k_pos, step):
    """`step` run only where block (i, j)'s positions may pair (explicit positions), else the carry kept."""
    if not plan.dynamic:
        return step

    def maybe(carry, pair):
        i, j = pair
        qp, kp = _slice(q_pos, i * plan.bq, plan.bq, 0), _slice(k_pos, j * plan.bk, plan.bk, 0)
        return jax.lax.cond(arrays.may_pair(qp, kp), step, lambda c, _: (c, None), carry, pair)

    return maybe


def forward(plan: Plan, q, k, v, bias_params, arrays, q_pos, k_pos):
    """The online softmax over the visible pairs -> out [B, Lp, K, G, Dh] float32 (0 where a query sees
    nothing) and its log-sum-exp [B, K, G, Lp] (-inf there)."""
    stats = jnp.full_like(jnp.moveaxis(q[..., 0], 1, 3), -jnp.inf, jnp.float32)  # [B, K, G, Lp]

    def step(carry, pair):
        acc, m, total = carry
        i, j = pair
        s, *_ = _scores(plan, i, j, q, k, bias_params, arrays, q_pos, k_pos)
        vb = _slice(v, j * plan.bk, plan.bk, 1)  # [B, bk, K, Dh]
        m_old = _slice(m, i * plan.bq, plan.bq, 3)  # [B, K, G, bq]
        m_new = jnp.maximum(m_old, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])  # [B, K, G, bq, bk]
        scale = jnp.exp(m_old - m_safe)  # [B, K, G, bq]
        t = _slice(total, i * plan.bq, plan.bq, 3) * scale + p.sum(-1)
        a = _slice(acc, i * plan.bq, plan.bq, 1)  # [B, bq, K, G, Dh]
        a = a * jnp.moveaxis(scale, 3, 1)[..., None] + jnp.einsum(
            "bkgqs,bskd->bqkgd", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
        return (jax.lax.dynamic_update_slice_in_dim(acc, a, i * plan.bq, 1),
                jax.lax.dynamic_update_slice_in_dim(m, m_new, i * plan.bq, 3),
                jax.lax.dynamic_update_slice_in_dim(total, t, i * plan.bq, 3)), None

    init = (jnp.zeros_like(q, jnp.float32), stats, jnp.zeros_like(stats))
    (acc, m, total), _ = jax.lax.scan(_skipping(plan, arrays, q_pos, k_pos, step), init, plan.scanned())
    seen = total > 0
    out = acc / jnp.moveaxis(jnp.where(seen, total, 1.0), 3, 1)[..., None]  # [B, Lp, K, G, Dh]
    return out, jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)


def backward(plan: Plan, q, k, v, bias_params, arrays, q_pos, k_pos, lse, delta, d_out):
    """Gradients (float32) of q, k, v and the bias's parameters from each visible block's probabilities,
    recomputed with the log-sum-exp `lse` [B, K, G, Lp] (of all the keys a query sees, which a ring
    hop's k, v are a part of); delta = `delta_of(out, d_out)`."""
    lse = jnp.where(jnp.isfinite(lse), lse, jnp.inf)  # a query that sees nothing: p = 0

    def step(carry, pair):
        dq, dk, dv, dbias = carry
        i, j = pair
        s, qb, kb, qp, kp = _scores(plan, i, j, q, k, bias_params, arrays, q_pos, k_pos)
        vb = _slice(v, j * plan.bk, plan.bk, 1)  # [B, bk, K, Dh]
        dob = _slice(d_out, i * plan.bq, plan.bq, 1)  # [B, bq, K, G, Dh]
        p = jnp.exp(s - _slice(lse, i * plan.bq, plan.bq, 3)[..., None])  # [B, K, G, bq, bk]
        dp = jnp.einsum("bqkgd,bskd->bkgqs", dob, vb, preferred_element_type=jnp.float32)
        ds = p * (dp - _slice(delta, i * plan.bq, plan.bq, 3)[..., None])
        dvb = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(dob.dtype), dob, preferred_element_type=jnp.float32)
        dkb = jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(qb.dtype), qb, preferred_element_type=jnp.float32)
        dqb = jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(kb.dtype), kb, preferred_element_type=jnp.float32)
        add = lambda x, d, start: jax.lax.dynamic_update_slice_in_dim(x, _slice(x, start, d.shape[1], 1) + d, start, 1)
        if plan.bias_fn is not None:
            vary = jnp.zeros_like(ds[(0,) * ds.ndim])  # the bias's gradient varies where ds does (shard_map)
            params = jax.tree.map(lambda x: x.astype(jnp.float32) + vary, bias_params)
            _, pullback = jax.vjp(lambda p_: plan.bias_fn(p_, qp, kp).astype(jnp.float32), params)
            dbias = jax.tree.map(jnp.add, dbias, pullback(ds.sum(0).reshape(-1, *ds.shape[3:]))[0])
        return (add(dq, dqb, i * plan.bq), add(dk, dkb, j * plan.bk), add(dv, dvb, j * plan.bk), dbias), None

    zeros = lambda x: jnp.zeros_like(x, jnp.float32) + jnp.zeros_like(q[(0,) * q.ndim], jnp.float32)
    init = (zeros(q), zeros(k), zeros(v), jax.tree.map(zeros, bias_params))  # varying where q is (shard_map)
    (dq, dk, dv, dbias), _ = jax.lax.scan(_skipping(plan, arrays, q_pos, k_pos, step), init, plan.scanned())
    return dq, dk, dv, jax.tree.map(lambda g, x: g.astype(x.dtype), dbias, bias_params)
