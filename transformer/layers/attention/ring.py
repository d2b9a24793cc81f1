"""Ring attention: a sequence split over the mesh's `context` axis, keys and values passed around it.

Glossary of shapes: B batch, L queries and S keys of the whole sequence, N devices on the context
axis, each holding C = L / N queries and S / N keys; K kv heads, G = H // K, Dh head width.

Every device keeps its queries. The N parts of the keys and values, with their positions,
segments and validity, travel around the ring (`jax.lax.ppermute` inside `jax.shard_map`),
and each hop is one call of blockwise's kernel (the Pallas kernel on a GPU), whose output and
log-sum-exp merge into the running result. The backward pass goes around the ring again: it
recomputes each hop's probabilities from the final log-sum-exp, adds each hop's dq at home and
sends dk, dv along with their keys and values, so that after N hops they are home. Grouped kv heads travel at
their own count. Positions are always explicit here (each device's true positions), so the
blocks a causal mask or a window leaves empty are skipped at run time; with the zigzag order
(`zigzag`) every device gets as much causal work as the others.
"""

from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from transformer import sharding
from transformer.layers.attention import blockwise, platforms
from transformer.layers.attention.blockwise import Operands
from transformer.layers.attention.masks import Bias, Mask
from transformer.layers.attention.platforms import BLOCKS
from transformer.sharding import BATCH, HEAD_DIM, HEADS, LENGTH

AXIS = "context"


def zigzag(length: int, parts: int) -> np.ndarray:
    """[L] the positions in the order that gives device d of `parts` the chunks d and 2 parts - 1 - d
    (of 2 parts chunks): a causal mask's work is then the same on every device."""
    if length % (2 * parts):
        raise ValueError(f"a sequence of {length} does not split into 2 x {parts} chunks for the context axis")
    chunks = np.arange(length).reshape(2 * parts, -1)
    return np.concatenate([np.concatenate([chunks[d], chunks[2 * parts - 1 - d]]) for d in range(parts)])


def context_size() -> int:
    """The context axis's size in the mesh a step is traced on (1 outside a sharding context)."""
    active = sharding.active()
    return 1 if active is None else active[0].shape.get(AXIS, 1)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, block: int = 512) -> jax.Array:
    """q [B, L, H, Dh], k, v [B, S, K, Dh] (split over the context axis by the active mesh's rules)
    -> [B, L, H, Dh]; blockwise attention where the context axis has one device."""
    parts = context_size()
    if parts == 1:
        return blockwise.attention(q, k, v, mask, block, kernel=BLOCKS)
    mesh, rules = sharding.active()
    length, source_length = q.shape[1], k.shape[1]
    q_pos, k_pos = mask.positions(length, source_length)
    arrays = mask.replace(query_positions=None, key_positions=None, bias=None,
                          key_segments=mask.segments if mask.key_segments is None else mask.key_segments,
                          extent=max(mask.extent, source_length))
    spec = lambda *axes: sharding.mesh_spec(axes, rules)
    heads = spec(BATCH, LENGTH, HEADS, HEAD_DIM)
    head_axes = () if heads[2] is None else (heads[2],) if isinstance(heads[2], str) else heads[2]
    per_head = mask.bias is not None and mask.bias.per_head
    if mask.bias is not None and not per_head and math.prod(mesh.shape[a] for a in head_axes) > 1:
        raise ValueError("ring attention with a position bias needs the heads whole: set config.mesh.tensor=1")
    replicated = tuple(a for a in mesh.axis_names if not (per_head and a in head_axes))  # the bias's gradient sums
    local = functools.partial(_local, bias_fn=None if mask.bias is None else mask.bias.fn, block=block,
                              parts=parts, axes=replicated)
    bias_spec = P() if mask.bias is None else platforms.bias_specs(mask.bias, rules).params
    run = jax.shard_map(local, mesh=mesh, out_specs=heads, in_specs=(
        heads, heads, heads, bias_spec, jax.tree.map(lambda _: spec(BATCH, LENGTH), arrays), spec(LENGTH),
        spec(LENGTH)))
    return run(q, k, v, None if mask.bias is None else mask.bias.params, arrays,
               jnp.broadcast_to(q_pos, (length,)), jnp.broadcast_to(k_pos, (source_length,)))


def _local(q, k, v, bias_params, arrays: Mask, q_pos, k_pos, *, bias_fn, block: int, parts: int, axes: tuple):
    """One device's part: q [B, C, H, Dh], k, v [B, S / N, K, Dh], arrays and positions of its tokens."""
    b, c, h, dh = q.shape
    mask = arrays.replace(query_positions=q_pos, key_positions=k_pos,
                          bias=None if bias_fn is None else Bias(bias_params, bias_fn))
    plan, x = blockwise.prepare(q, k, v, mask, block)
    out = _ring(plan, (parts, axes), x)
    return out[:, :c].reshape(b, c, h, dh)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(plan: blockwise.Plan, ring: tuple, x: Operands) -> jax.Array:
    """The attention of x's queries to the keys of every device: out [B, Cp, K, G, Dh] in q's dtype."""
    return _forward(plan, ring, x)[0]


def _forward(plan: blockwise.Plan, ring: tuple, x: Operands):
    """`ring` = (N, the mesh's axis names)."""
    parts = ring[0]
    out = jnp.zeros_like(x.q, jnp.float32)  # [B, Cp, K, G, Dh]
    lse = jnp.full_like(jnp.moveaxis(x.q[..., 0], 1, 3), -jnp.inf, jnp.float32)  # [B, K, G, Cp]
    keys = _keys(x)
    for hop in range(parts):
        out_h, lse_h = BLOCKS.forward(plan, _with_keys(x, keys))
        out, lse = _merge(out, lse, out_h, lse_h)
        if hop < parts - 1:
            keys = _send(keys, parts)
    out = out.astype(x.q.dtype)
    return out, (x, out, lse)


def _backward(plan: blockwise.Plan, ring: tuple, residuals, d_out):
    (parts, axes), (x, out, lse) = ring, residuals
    delta = blockwise.delta_of(out, d_out)
    dq = jnp.zeros_like(x.q, jnp.float32)
    dbias = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), x.bias_params)
    keys, dk, dv = _keys(x), jnp.zeros_like(x.k, jnp.float32), jnp.zeros_like(x.v, jnp.float32)
    for hop in range(parts):
        dq_h, dk_h, dv_h, dbias_h = BLOCKS.backward(plan, _with_keys(x, keys), lse, delta, d_out)
        dq = dq + dq_h
        dbias = jax.tree.map(jnp.add, dbias, dbias_h)
        dk, dv = dk + dk_h, dv + dv_h
        if hop < parts - 1:
            keys, dk, dv = _send((keys, dk, dv), parts)
        else:
            dk, dv = _send((dk, dv), parts)  # home
    dbias = jax.lax.psum(dbias, axes)  # every device's queries' share, over the axes the bias is replicated on
    return (blockwise.cotangent(x, dq, dk, dv, jax.tree.map(lambda g, p: g.astype(p.dtype), dbias, x.bias_params)),)


_ring.defvjp(_forward, _backward)


def _merge(out, lse, out_h, lse_h):
    """Two softmax-normalised partial outputs [B, Cp, K, G, Dh] and log-sum-exps [B, K, G, Cp] -> one."""
    new = jnp.logaddexp(lse, lse_h)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    weight = lambda x: jnp.moveaxis(jnp.exp(x - safe), 3, 1)[..., None]  # [B, Cp, K, G, 1]; 0 where x = -inf
    return out * weight(lse) + out_h * weight(lse_h), new


@flax.struct.dataclass
class Keys:
    """What travels around the ring: a device's keys and values, their positions and the mask's
    key-side arrays (key_valid, key_segments); the queries' segments stay home."""

    k: jax.Array      # [B, Sp, K, Dh]: a device's S / N keys, padded to the blocks
    v: jax.Array      # [B, Sp, K, Dh]
    k_pos: jax.Array  # [Sp]
    arrays: Mask


def _keys(x: Operands) -> Keys:
    return Keys(x.k, x.v, x.k_pos, x.arrays.replace(segments=None))


def _with_keys(x: Operands, keys: Keys) -> Operands:
    """x's queries with the keys of another device."""
    return x.replace(k=keys.k, v=keys.v, k_pos=keys.k_pos, arrays=keys.arrays.replace(segments=x.arrays.segments))


def _send(tree, parts: int):
    """Every device's `tree` to the next device of the ring."""
    return jax.lax.ppermute(tree, AXIS, [(i, (i + 1) % parts) for i in range(parts)])
