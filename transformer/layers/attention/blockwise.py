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

Read top to bottom: `attention`, the entry; `forward` and `backward`, the recurrence; then the
plumbing: a call's static `Plan` and its `Operands` (what `prepare` makes of q, k, v and the
mask), the `Kernel` that runs the blocks (XLA's `Scan` here, a fused kernel on a GPU:
`platforms.BLOCKS` chooses) and the gradient's wiring.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from transformer.layers.attention.masks import FAR, Mask


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, block: int = 512,
              kernel: Kernel | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(Dh) + bias) v over the allowed pairs: q [B, L, H, Dh], k, v [B, S, K, Dh]
    -> [B, L, H, Dh] in q's dtype, with the scores and softmax in float32. `kernel` runs the visible
    blocks (default: XLA's scan, `forward` and `backward` below)."""
    b, length, h, dh = q.shape
    prepared = prepare(q, k, v, mask, block)
    if prepared is None:
        return jnp.zeros_like(q)
    plan, x = prepared
    out = _attention(plan, kernel or SCAN, x)  # [B, Lp, K, G, Dh]
    return out[:, :length].reshape(b, length, h, dh)


def forward(plan: Plan, x: Operands) -> tuple[jax.Array, jax.Array]:
    """The online softmax over the visible pairs -> out [B, Lp, K, G, Dh] float32 (0 where a query sees
    nothing) and its log-sum-exp [B, K, G, Lp] (-inf there)."""
    stats = jnp.full_like(jnp.moveaxis(x.q[..., 0], 1, 3), -jnp.inf, jnp.float32)  # [B, K, G, Lp]

    def step(carry, pair):
        acc, m, total = carry
        i, j = pair
        s, *_ = _scores(plan, i, j, x)
        vb = _slice(x.v, j * plan.bk, plan.bk, 1)  # [B, bk, K, Dh]
        m_old = _slice(m, i * plan.bq, plan.bq, 3)  # [B, K, G, bq]
        m_new = jnp.maximum(m_old, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])  # [B, K, G, bq, bk]
        scale = jnp.exp(m_old - m_safe)  # [B, K, G, bq]
        t = _slice(total, i * plan.bq, plan.bq, 3) * scale + p.sum(-1)
        a = _slice(acc, i * plan.bq, plan.bq, 1)  # [B, bq, K, G, Dh]
        a = a * jnp.moveaxis(scale, 3, 1)[..., None] + jnp.einsum(
            "bkgqs,bskd->bqkgd", p.astype(x.v.dtype), vb, preferred_element_type=jnp.float32)
        return (jax.lax.dynamic_update_slice_in_dim(acc, a, i * plan.bq, 1),
                jax.lax.dynamic_update_slice_in_dim(m, m_new, i * plan.bq, 3),
                jax.lax.dynamic_update_slice_in_dim(total, t, i * plan.bq, 3)), None

    init = (jnp.zeros_like(x.q, jnp.float32), stats, jnp.zeros_like(stats))
    (acc, m, total), _ = jax.lax.scan(_skipping(plan, x, step), init, plan.scanned())
    seen = total > 0
    out = acc / jnp.moveaxis(jnp.where(seen, total, 1.0), 3, 1)[..., None]  # [B, Lp, K, G, Dh]
    return out, jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)


def backward(plan: Plan, x: Operands, lse: jax.Array, delta: jax.Array, d_out: jax.Array) -> tuple:
    """Gradients (float32) of q, k, v and the bias's parameters from each visible block's probabilities,
    recomputed with the log-sum-exp `lse` [B, K, G, Lp] (of all the keys a query sees, which a ring
    hop's k, v are a part of); delta = `delta_of(out, d_out)`."""
    lse = jnp.where(jnp.isfinite(lse), lse, jnp.inf)  # a query that sees nothing: p = 0

    def step(carry, pair):
        dq, dk, dv, dbias = carry
        i, j = pair
        s, qb, kb, qp, kp = _scores(plan, i, j, x)
        vb = _slice(x.v, j * plan.bk, plan.bk, 1)  # [B, bk, K, Dh]
        dob = _slice(d_out, i * plan.bq, plan.bq, 1)  # [B, bq, K, G, Dh]
        p = jnp.exp(s - _slice(lse, i * plan.bq, plan.bq, 3)[..., None])  # [B, K, G, bq, bk]
        dp = jnp.einsum("bqkgd,bskd->bkgqs", dob, vb, preferred_element_type=jnp.float32)
        ds = p * (dp - _slice(delta, i * plan.bq, plan.bq, 3)[..., None])
        dvb = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(dob.dtype), dob, preferred_element_type=jnp.float32)
        dkb = jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(qb.dtype), qb, preferred_element_type=jnp.float32)
        dqb = jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(kb.dtype), kb, preferred_element_type=jnp.float32)
        add = lambda y, d, start: jax.lax.dynamic_update_slice_in_dim(y, _slice(y, start, d.shape[1], 1) + d, start, 1)
        if plan.bias_fn is not None:
            vary = jnp.zeros_like(ds[(0,) * ds.ndim])  # the bias's gradient varies where ds does (shard_map)
            params = jax.tree.map(lambda y: y.astype(jnp.float32) + vary, x.bias_params)
            _, pullback = jax.vjp(lambda p_: plan.bias_fn(p_, qp, kp).astype(jnp.float32), params)
            dbias = jax.tree.map(jnp.add, dbias, pullback(ds.sum(0).reshape(-1, *ds.shape[3:]))[0])
        return (add(dq, dqb, i * plan.bq), add(dk, dkb, j * plan.bk), add(dv, dvb, j * plan.bk), dbias), None

    zeros = lambda y: jnp.zeros_like(y, jnp.float32) + jnp.zeros_like(x.q[(0,) * x.q.ndim], jnp.float32)
    init = (zeros(x.q), zeros(x.k), zeros(x.v), jax.tree.map(zeros, x.bias_params))  # varying where q is (shard_map)
    (dq, dk, dv, dbias), _ = jax.lax.scan(_skipping(plan, x, step), init, plan.scanned())
    return dq, dk, dv, jax.tree.map(lambda g, y: g.astype(y.dtype), dbias, x.bias_params)


def _scores(plan: Plan, i, j, x: Operands):
    """Block (i, j)'s masked scores [B, K, G, bq, bk] float32 (-inf where not allowed), its q, k slices
    and its positions."""
    qb = _slice(x.q, i * plan.bq, plan.bq, 1)  # [B, bq, K, G, Dh]
    kb = _slice(x.k, j * plan.bk, plan.bk, 1)  # [B, bk, K, Dh]
    qp, kp = _slice(x.q_pos, i * plan.bq, plan.bq, 0), _slice(x.k_pos, j * plan.bk, plan.bk, 0)  # [bq], [bk]
    s = jnp.einsum("bqkgd,bskd->bkgqs", qb, kb, preferred_element_type=jnp.float32)  # [B, K, G, bq, bk]
    if plan.bias_fn is not None:
        s = s + plan.bias_fn(x.bias_params, qp, kp).astype(jnp.float32).reshape(s.shape[1:])
    key_in = j * plan.bk + jnp.arange(plan.bk) < plan.source_length
    allowed = x.arrays.block(qp, kp, plan.source_length, ((i * plan.bq, plan.bq), (j * plan.bk, plan.bk)), key_in)
    return jnp.where(allowed[:, None, None], s, -jnp.inf), qb, kb, qp, kp


def _skipping(plan: Plan, x: Operands, step):
    """`step` run only where block (i, j)'s positions may pair (explicit positions), else the carry kept."""
    if not plan.dynamic:
        return step

    def maybe(carry, pair):
        i, j = pair
        qp, kp = _slice(x.q_pos, i * plan.bq, plan.bq, 0), _slice(x.k_pos, j * plan.bk, plan.bk, 0)
        return jax.lax.cond(x.arrays.may_pair(qp, kp), step, lambda c, _: (c, None), carry, pair)

    return maybe


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


@flax.struct.dataclass
class Operands:
    """One call's arrays in the kernels' layout (`prepare`): what a `Kernel` reads, what the gradient
    flows to, and, in ring attention, what each hop's keys replace."""

    q: jax.Array             # [B, Lp, K, G, Dh], scaled by Dh^-0.5
    k: jax.Array             # [B, Sp, K, Dh]
    v: jax.Array             # [B, Sp, K, Dh]
    bias_params: object      # the bias function's parameters (None: no bias)
    arrays: Mask             # the mask's arrays padded to the blocks (no positions, no bias)
    q_pos: jax.Array         # [Lp] int
    k_pos: jax.Array         # [Sp] int (FAR past S)


def prepare(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, block: int) -> tuple[Plan, Operands] | None:
    """q [B, L, H, Dh], k, v [B, S, K, Dh] -> the call's plan and operands (None: the mask leaves no block)."""
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
    return plan, Operands(q=q, k=_pad(k, sp), v=_pad(v, sp),
                          bias_params=None if mask.bias is None else mask.bias.params,
                          arrays=_padded_arrays(mask, lp, sp),
                          q_pos=_pad(jnp.broadcast_to(q_pos, (length,)), lp),
                          k_pos=_pad(jnp.broadcast_to(k_pos, (source_length,)), sp, FAR))


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


class Kernel(Protocol):
    """What runs the visible pairs of a `Plan` on its `Operands`: XLA's scan (`Scan`) or a fused kernel
    (`kernels/pallas_gpu.Flash`); `platforms.BLOCKS` picks one per platform, ring attention runs it
    once per hop."""

    def forward(self, plan: Plan, x: Operands) -> tuple[jax.Array, jax.Array]:
        """-> out [B, Lp, K, G, Dh] float32 (0 where a query sees nothing), log-sum-exp [B, K, G, Lp] (-inf there)."""

    def backward(self, plan: Plan, x: Operands, lse: jax.Array, delta: jax.Array, d_out: jax.Array) -> tuple:
        """-> float32 dq, dk, dv and the bias parameters' gradient (in their dtype), given the log-sum-exp
        of all the keys a query sees and delta = `delta_of(out, d_out)`."""


@dataclasses.dataclass(frozen=True)
class Scan:
    """XLA's scan over the visible pairs (`forward`, `backward` above), on any platform."""

    def forward(self, plan: Plan, x: Operands) -> tuple[jax.Array, jax.Array]:
        return forward(plan, x)

    def backward(self, plan: Plan, x: Operands, lse: jax.Array, delta: jax.Array, d_out: jax.Array) -> tuple:
        return backward(plan, x, lse, delta, d_out)


SCAN = Scan()


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(plan: Plan, kernel: Kernel, x: Operands) -> jax.Array:
    """The kernel's output [B, Lp, K, G, Dh] in q's dtype, differentiated by the kernel's backward."""
    return kernel.forward(plan, x)[0].astype(x.q.dtype)


def _attention_fwd(plan: Plan, kernel: Kernel, x: Operands):
    out, lse = kernel.forward(plan, x)
    out = out.astype(x.q.dtype)
    return out, (x, out, lse)


def _attention_bwd(plan: Plan, kernel: Kernel, residuals, d_out):
    x, out, lse = residuals
    dq, dk, dv, dbias = kernel.backward(plan, x, lse, delta_of(out, d_out), d_out)
    return (cotangent(x, dq, dk, dv, dbias),)


_attention.defvjp(_attention_fwd, _attention_bwd)


def cotangent(x: Operands, dq: jax.Array, dk: jax.Array, dv: jax.Array, dbias) -> Operands:
    """The gradients as x's cotangent: dq, dk, dv in the dtypes of x's q, k, v; float0 for the mask's
    arrays and the positions."""
    return Operands(q=dq.astype(x.q.dtype), k=dk.astype(x.k.dtype), v=dv.astype(x.v.dtype), bias_params=dbias,
                    arrays=no_grad(x.arrays), q_pos=no_grad(x.q_pos), k_pos=no_grad(x.k_pos))


def no_grad(tree):
    """The (float0) cotangent of integer and boolean inputs."""
    return jax.tree.map(lambda x: np.zeros(np.shape(x), jax.dtypes.float0), tree)


def delta_of(out: jax.Array, d_out: jax.Array) -> jax.Array:
    """rowsum(dO * O) [B, K, G, Lp] float32, the softmax backward's correction: out, d_out [B, Lp, K, G, Dh]."""
    return jnp.moveaxis(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1), 1, 3)


def _slice(x, start, size, axis):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)
