"""How a mixture of experts' token-slots reach their experts and come back: `dense` (the reference),
`dropless` (sorted groups and a grouped matmul) and `capacity` (fixed buffers); on a mesh whose
`expert` axis has several devices, the slots travel between devices with all-to-all inside
`jax.shard_map`.

Glossary of shapes: B batch, L length, D model width, F expert mlp width, E experts, k experts per
token, T tokens (B L: a device's own under a mesh), S = T k token-slots (token t's k slots
consecutive), C capacity, N devices on the expert axis, El = E / N experts on each, R buffer rows a
device sends to each other.

dense: every expert on every token ([E, T, D], the memory of E dense MLPs), each output weighed by
its router weight, 0 for the experts a token did not choose. What the others are tested against.

dropless: a device sorts its S slots by expert (stably: token order within an expert) and runs each
expert's rows through its weights with one `jax.lax.ragged_dot` per matmul, given the group sizes (under
vmap, the engine's slots, one over the whole batch sorted by expert: `ragged_matmul`);
the rows are unsorted and each token's k outputs summed with its router weights. Over an expert
axis, the sorted slots go to the device holding their expert (`jax.lax.all_to_all`, which needs
fixed shapes) in a buffer of R = T min(k, El) rows per destination: the most one device can send
to another, since a token's k experts differ, so no slot is ever dropped, at the price of buffers
of N min(k, El) / k times the slots (sent whole by all-to-all). The receiver sorts what arrived by its
own experts, computes, and sends each row back to where it came from. (`jax.lax.ragged_all_to_all`, which sends only the
filled rows, has no CPU implementation to test it with.)

capacity: each sequence gives each expert C places (the module computes C = ceil(capacity_factor
L k / E)); a slot takes the next free place of its expert in sequence order (earlier tokens first)
and a slot past C is dropped: it adds 0 to its token's output. `queue_positions` numbers the slots
in the whole sequence, so which slots are dropped does not depend on the mesh. Each device fills a
[B, E, C, D] buffer (empty places are zeros), which reaches the experts' devices whole by
all-to-all; every expert runs its [C, D] rows as one batched matmul. Shapes are fixed; the work is
capacity_factor x the dropless work, padding included.

Under a mesh, the tokens keep the split of activations [batch, length] (data x fsdp x expert,
context) and every device routes its own; the expert weights enter whole but for their expert split
and their mlp split (FSDP's embed split is gathered at the door); an mlp split over `tensor` gives
each device a partial sum of the down projection, added over the axis (Megatron's MLP). The
expert biases, where there are any, are added after that sum.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from transformer import sharding
from transformer.layers.mlp import ACTIVATIONS, GATES
from transformer.sharding import BATCH, EMBED, EXPERT, LENGTH, MLP


class Experts(NamedTuple):
    """Stacked expert weights: up, gate [E, D, F], down [E, F, D]; biases [E, F], [E, F], [E, D].
    gate and the biases are None where the form has none."""

    up: jax.Array
    down: jax.Array
    gate: jax.Array | None = None
    up_bias: jax.Array | None = None
    gate_bias: jax.Array | None = None
    down_bias: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Axes:
    """The mesh axes a device's part of the work is split over: `expert` (N = `size` devices, each
    holding El experts) and `tensor` (each expert's F split, its down projection a partial sum)."""

    expert: tuple[str, ...] = ()
    size: int = 1
    tensor: tuple[str, ...] = ()


def expert_mlp(x: jax.Array, w: Experts, matmul, bias, activation: str, axes: Axes) -> jax.Array:
    """The experts' MLP (the forms of `Mlp`) on rows already grouped by expert; `matmul(a, kernel)`
    and `bias(b)` say how rows meet their expert's weights."""
    h = matmul(x, w.up) + bias(w.up_bias)
    if activation in GATES:
        h = h * GATES[activation](matmul(x, w.gate) + bias(w.gate_bias))
    else:
        h = ACTIVATIONS[activation](h)
    y = matmul(h, w.down)
    if axes.tensor:
        y = jax.lax.psum(y, axes.tensor)
    return y + bias(w.down_bias)


def _batched(x: jax.Array, w: Experts, activation: str, dtype, axes: Axes) -> jax.Array:
    """x [..., El, M, D] (M rows for each expert) -> [..., El, M, D]."""
    matmul = lambda a, kernel: jnp.einsum("...emd,edf->...emf", a.astype(dtype), kernel.astype(dtype),
                                          preferred_element_type=jnp.float32)
    bias = lambda b: 0.0 if b is None else b[:, None, :]  # [El, 1, F]
    return expert_mlp(x, w, matmul, bias, activation, axes)


def _ragged(a: jax.Array, kernel: jax.Array, sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(a, kernel, sizes, preferred_element_type=jnp.float32)


@jax.custom_batching.custom_vmap
def _ragged_batched(a, kernel, sizes):
    return _ragged(a, kernel, sizes)


@_ragged_batched.def_vmap
def _ragged_rule(axis_size: int, in_batched, a, kernel, sizes):
    """jax 0.10's ragged_dot batches only when all three operands are batched: batched rows [B, M, D] and
    sizes [B, E] against one kernel [E, D, F] (the engine's slots) become one grouped matmul of B M rows,
    sorted by expert across the batch, so the kernel is read once; a batched kernel batches all three."""
    rows_batched, kernel_batched, sizes_batched = in_batched
    a = a if rows_batched else jnp.broadcast_to(a, (axis_size,) + a.shape)
    sizes = sizes if sizes_batched else jnp.broadcast_to(sizes, (axis_size,) + sizes.shape)
    if kernel_batched:
        return jax.vmap(_ragged)(a, kernel, sizes), True
    b, m, d = a.shape
    ends = jnp.cumsum(sizes, axis=1)  # [B, E]
    expert = jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(m), side="right"))(ends)  # [B, M], E: padding
    order = jnp.argsort(expert.reshape(-1), stable=True)
    y = _ragged_batched(a.reshape(b * m, d)[order], kernel, sizes.sum(0).astype(sizes.dtype))
    return y[_inverse(order)].reshape(b, m, -1), True


@jax.custom_vjp
def ragged_matmul(a: jax.Array, kernel: jax.Array, sizes: jax.Array) -> jax.Array:
    """rows a [M, D] sorted by expert, `sizes` [E] rows each, @ kernel [E, D, F] -> [M, F] in float32: one
    `jax.lax.ragged_dot`, batched under vmap by `_ragged_rule`; its gradient is ragged_dot's own."""
    return _ragged_batched(a, kernel, sizes)


def _ragged_fwd(a, kernel, sizes):
    return _ragged_batched(a, kernel, sizes), (a, kernel, sizes)


def _ragged_bwd(saved, g):
    a, kernel, sizes = saved
    return (*jax.vjp(lambda a, kernel: _ragged(a, kernel, sizes), a, kernel)[1](g), None)


ragged_matmul.defvjp(_ragged_fwd, _ragged_bwd)


def _grouped(rows: jax.Array, sizes: jax.Array, expert_of_row: jax.Array, w: Experts, activation: str, dtype,
             axes: Axes) -> jax.Array:
    """rows [M, D] sorted by expert, `sizes` [El] rows each (rows past their sum are padding, their
    outputs meaningless), expert_of_row [M] -> [M, D]."""
    matmul = lambda a, kernel: ragged_matmul(a.astype(dtype), kernel.astype(dtype), sizes)
    bias = lambda b: 0.0 if b is None else b[expert_of_row]  # [M, F]
    return expert_mlp(rows, w, matmul, bias, activation, axes)


def _combine(y: jax.Array, weights: jax.Array, dtype) -> jax.Array:
    """Each token's k outputs y [B, L, k, D] summed with its router weights [B, L, k] -> [B, L, D]."""
    return jnp.einsum("blkd,blk->bld", y.astype(jnp.float32), weights.astype(jnp.float32)).astype(dtype)


def _inverse(order: jax.Array) -> jax.Array:
    """The permutation that undoes `order` (x[order][_inverse(order)] == x)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))


def dense(x, ids, weights, w: Experts, *, activation: str, dtype) -> jax.Array:
    """x [B, L, D], ids and weights [B, L, k] -> [B, L, D]: every expert on every token."""
    b, length, d = x.shape
    e = w.up.shape[0]
    chosen = jnp.einsum("blk,blke->ble", weights.astype(jnp.float32), jax.nn.one_hot(ids, e, dtype=jnp.float32))
    every = jnp.broadcast_to(x.reshape(1, b * length, d), (e, b * length, d))  # [E, T, D]
    y = _batched(every, w, activation, dtype, Axes())  # [E, T, D]
    return jnp.einsum("etd,te->td", y, chosen.reshape(b * length, e)).reshape(b, length, d).astype(dtype)


def dropless(x, ids, weights, w: Experts, *, activation: str, dtype, axes: Axes = Axes()) -> jax.Array:
    """x [B, L, D], ids and weights [B, L, k] -> [B, L, D]; the experts of `w` are this device's El."""
    b, length, d = x.shape
    k = ids.shape[-1]
    experts = w.up.shape[0] * axes.size
    slots = ids.reshape(-1)  # [S]
    order = jnp.argsort(slots, stable=True)
    rows = x.reshape(b * length, d)[order // k]  # [S, D] grouped by expert
    sizes = jnp.bincount(slots, length=experts).astype(jnp.int32)  # [E]
    if axes.size == 1:
        y = _grouped(rows, sizes, slots[order], w, activation, dtype, axes)
    else:
        y = _exchanged(rows, slots[order], sizes, w, activation, dtype, axes, b * length * min(k, w.up.shape[0]))
    return _combine(y[_inverse(order)].reshape(b, length, k, d), weights, dtype)


def _exchanged(rows, expert_of_row, sizes, w: Experts, activation: str, dtype, axes: Axes, r: int) -> jax.Array:
    """`dropless` over the expert axis: rows [S, D] sorted by their expert (global ids `expert_of_row`,
    counts `sizes` [E]) to the devices holding their experts, through them, and back -> [S, D]."""
    n, el = axes.size, w.up.shape[0]
    s, d = rows.shape
    destination = expert_of_row // el  # [S]
    per_destination = sizes.reshape(n, el).sum(1)  # [N]
    place = jnp.arange(s) - (jnp.cumsum(per_destination) - per_destination)[destination]  # row within its block
    send = jnp.zeros((n, r, d), rows.dtype).at[destination, place].set(rows, unique_indices=True)  # [N, R, D]
    exchange = lambda a: jax.lax.all_to_all(a, axes.expert, 0, 0)
    arrived = exchange(send)  # [N, R, D]: block i from device i, sorted by its expert
    counts = exchange(sizes.reshape(n, el))  # [N, El]: how many rows each device sent each of my experts
    ends = jnp.cumsum(counts, axis=1)
    local = jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(r), side="right"))(ends).reshape(-1)  # [N R]
    by_expert = jnp.argsort(local, stable=True)  # El marks padding: it sorts last
    mine = _grouped(arrived.reshape(n * r, d)[by_expert], counts.sum(0), jnp.minimum(local[by_expert], el - 1), w,
                    activation, dtype, axes)
    back = exchange(mine[_inverse(by_expert)].reshape(n, r, d))  # [N, R, D]: my rows, from each device
    return back[destination, place]


def queue_positions(ids: jax.Array, experts: int) -> jax.Array:
    """ids [B, L, k] -> [B, L, k]: each slot's place in its expert's queue for its sequence, in
    sequence order (token by token, a token's k slots in turn)."""
    b, length, k = ids.shape
    slots = ids.reshape(b, length * k)
    order = jnp.argsort(slots, axis=1, stable=True)
    counts = jax.vmap(lambda row: jnp.bincount(row, length=experts))(slots)  # [B, E]
    starts = jnp.cumsum(counts, axis=1) - counts
    sorted_ids = jnp.take_along_axis(slots, order, axis=1)
    in_order = jnp.arange(length * k)[None, :] - jnp.take_along_axis(starts, sorted_ids, axis=1)
    rows = jnp.arange(b)[:, None]
    return jnp.zeros_like(slots).at[rows, order].set(in_order).reshape(b, length, k)


def capacity(x, ids, weights, positions, w: Experts, *, places: int, activation: str, dtype,
             axes: Axes = Axes()) -> jax.Array:
    """x [B, L, D], ids, weights, positions (`queue_positions`) [B, L, k] -> [B, L, D], each expert
    taking `places` (C) slots of each sequence."""
    b, length, d = x.shape
    k = ids.shape[-1]
    n, el = axes.size, w.up.shape[0]
    place = jnp.where(positions < places, ids * places + positions, n * el * places)  # E C: dropped
    place = place.reshape(b, length * k)
    rows = jnp.arange(b)[:, None]
    buffer = jnp.zeros((b, n * el * places, d), x.dtype).at[rows, place].add(
        jnp.repeat(x, k, axis=1), mode="drop")  # [B, E C, D]
    buffer = buffer.reshape(b, n, el, places, d)
    if n > 1:
        buffer = jax.lax.all_to_all(buffer, axes.expert, 1, 1)  # [B, N, El, C, D]: axis 1 now the sender
    y = _batched(buffer, w, activation, dtype, axes)
    if n > 1:
        y = jax.lax.all_to_all(y, axes.expert, 1, 1)
    y = y.reshape(b, n * el * places, d).at[rows, place].get(mode="fill", fill_value=0)  # [B, S, D]
    return _combine(y.reshape(b, length, k, d), weights, dtype)


def _mesh_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def on_devices(fn, x: jax.Array, routed: tuple[jax.Array, ...], w: Experts, **fields) -> jax.Array:
    """fn(x, *routed, w, axes=..., **fields) on each device's tokens under the active mesh
    (`sharding.sharding_context`), or on all of them at once outside one."""
    active = sharding.active()
    if active is None:
        return fn(x, *routed, w, **fields)
    mesh, rules = active
    batch, length, _ = sharding.mesh_spec((BATCH, LENGTH, EMBED), rules)
    expert, _, mlp = sharding.mesh_spec((EXPERT, EMBED, MLP), rules)
    token_axes = _mesh_axes(batch) + _mesh_axes(length)
    tensor = tuple(a for a in _mesh_axes(mlp) if a not in token_axes and mesh.shape[a] > 1)  # F split over a
    # token axis would add up other tokens' partial sums: such an F enters whole
    mlp = tensor or None
    size = math.prod(mesh.shape[a] for a in _mesh_axes(expert))
    if w.up.shape[0] % size:
        raise ValueError(f"{w.up.shape[0]} experts do not split over the {size} devices of the mesh axes "
                         f"{_mesh_axes(expert)}: set config.mesh.expert to a divisor of the number of experts")
    tokens = P(batch, length, None)
    specs = Experts(up=P(expert, None, mlp), down=P(expert, mlp, None),
                    gate=None if w.gate is None else P(expert, None, mlp),
                    up_bias=None if w.up_bias is None else P(expert, mlp),
                    gate_bias=None if w.gate_bias is None else P(expert, mlp),
                    down_bias=None if w.down_bias is None else P(expert, None))
    local = functools.partial(fn, axes=Axes(_mesh_axes(expert), size, tensor), **fields)
    run = jax.shard_map(local, mesh=mesh, in_specs=(tokens,) * (1 + len(routed)) + (specs,), out_specs=tokens)
    return run(x, *routed, w)
