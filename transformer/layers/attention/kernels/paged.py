"""A decode step's attention over the key/value cache read as pages: jax's Pallas `paged_attention` for
TPUs (Mosaic) and NVIDIA GPUs (Triton), the fused path of `auto` and `flash` for one new token.

Glossary of shapes: B rows, H query heads, K kv heads, G = H // K, C cache positions, Dh head width,
P = C / PAGE pages of one sequence, N = B x K sequences.

The cache is head-major, [B, K, C, Dh], so each (row, kv head) pair is one sequence of P pages of PAGE
positions in order: the whole cache is N x P pages with no copy, a sequence's G query heads attend to its
row's first `length` keys, and the page table is a constant. The kernels take one call over every row:
`rows_merged` gives the engine's vmap over its slots (each a batch-1 cache) the rule that folds them into
the kernel's batch, and on a mesh each device runs its own rows and heads (`on_devices`). TPU's kernel reads
keys and values in bfloat16 and needs Dh a multiple of 128; the GPU's pads G to 16 query rows a kv head.
"""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention
from jax.sharding import PartitionSpec as P

from transformer import sharding
from transformer.sharding import BATCH, HEADS

PAGE = 16  # cache positions a page


def refusal(q: jax.Array, k: jax.Array, platform: str) -> str | None:
    """Why the paged kernel of `platform` ('tpu' or 'gpu') does not take q [B, 1, H, Dh] over k [B, K, C, Dh]."""
    dh, positions = q.shape[-1], k.shape[2]
    if q.shape[1] != 1:
        return f"{q.shape[1]} queries a row (the paged kernel takes one new token)"
    if positions % PAGE:
        return f"a cache of {positions} positions, not a multiple of {PAGE}"
    if platform == "tpu" and dh % 128:
        return f"head width {dh}: TPU's paged kernel needs a multiple of 128"
    if platform == "gpu" and dh % 16:
        return f"head width {dh}: the GPU's paged kernel needs a multiple of 16"
    return None


def as_pages(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array):
    """q [B, 1, H, Dh], k, v [B, K, C, Dh], lengths [B] -> the kernels' operands: queries [N, G, Dh] (scaled by
    1/sqrt(Dh)), key and value pages [1, N x P, PAGE, Dh], the page table [N, P] and lengths [N]."""
    b, kv_heads, positions, dh = k.shape
    pages = positions // PAGE
    queries = (q * jnp.asarray(dh**-0.5, q.dtype)).reshape(b * kv_heads, -1, dh)
    paged = lambda x: x.reshape(1, b * kv_heads * pages, PAGE, dh)  # noqa: E731
    table = jnp.arange(b * kv_heads * pages, dtype=jnp.int32).reshape(b * kv_heads, pages)
    return queries, paged(k), paged(v), table, jnp.repeat(lengths.astype(jnp.int32), kv_heads)


def tpu(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    """q [B, 1, H, Dh], k, v [B, K, C, Dh], lengths [B] -> [B, 1, H, Dh] by TPU's paged kernel."""
    queries, k_pages, v_pages, table, lengths = as_pages(q, k, v, lengths)
    out = tpu_paged_attention(queries, k_pages, v_pages, lengths, table,
                              pages_per_compute_block=math.gcd(table.shape[1], 8))
    return out.reshape(q.shape).astype(q.dtype)


def gpu(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, interpret: bool = False) -> jax.Array:
    """q [B, 1, H, Dh], k, v [B, K, C, Dh], lengths [B] -> [B, 1, H, Dh] by the GPU's paged kernel (Triton;
    `interpret` runs it anywhere, slowly: the tests)."""
    queries, k_pages, v_pages, table, lengths = as_pages(q, k, v, lengths)
    splits = math.gcd(table.shape[1], 16)
    out = gpu_paged.paged_attention(queries, k_pages, v_pages, table, lengths, k_splits=splits,
                                    pages_per_compute_block=math.gcd(table.shape[1] // splits, 8),
                                    interpret=interpret)
    return out.reshape(q.shape).astype(q.dtype)


def rows_merged(kernel: Callable) -> Callable:
    """`kernel(q, k, v, lengths)` for a batch's rows (lengths [B], or () for all of them), under `jax.vmap` one
    call whose batch is the mapped axis times the rows: the engine's slots, each a batch-1 cache, in one call."""
    @jax.custom_batching.custom_vmap
    def call(q, k, v, lengths):
        return on_devices(kernel, q, k, v, jnp.broadcast_to(lengths, q.shape[:1]))

    @call.def_vmap
    def rule(size, batched, q, k, v, lengths):
        q, k, v = (x if b else jnp.broadcast_to(x, (size, *x.shape)) for x, b in zip((q, k, v), batched))
        lengths = jnp.broadcast_to(lengths.reshape(size if batched[3] else 1, -1), q.shape[:2])  # [size, B]
        merge = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
        out = call(merge(q), merge(k), merge(v), lengths.reshape(-1))
        return out.reshape(q.shape), True

    return call


def on_devices(kernel: Callable, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    """kernel(q, k, v, lengths) run by each device on its rows and heads where a step is traced on a mesh (a
    Mosaic or Triton call has no partitioning rule): `sharding_context`'s, else `jax.set_mesh`'s (the engine's)
    by the default rules. Rows go over the batch axes, heads over the tensor axis where they divide both H
    and K, else each whole; inside a shard_map (manual axes) the blocks are the device's already."""
    traced = jax.sharding.get_abstract_mesh()
    mesh, rules = sharding.active() or (traced, sharding.DEFAULT_RULES)
    if mesh.empty or mesh.size == 1 or traced.manual_axes:
        return kernel(q, k, v, lengths)
    spec = lambda *axes: sharding.mesh_spec(axes, rules)  # noqa: E731
    rows, heads = spec(BATCH)[0], spec(HEADS)[0]
    divides = lambda axes, n: axes is None or n % math.prod(  # noqa: E731
        mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)) == 0
    if not divides(rows, q.shape[0]):
        rows = None
    if not (divides(heads, q.shape[2]) and divides(heads, k.shape[1])):
        heads = None
    if rows is None and heads is None:
        return kernel(q, k, v, lengths)
    queries, cache = P(rows, None, heads, None), P(rows, heads, None, None)
    return jax.shard_map(kernel, mesh=mesh, in_specs=(queries, cache, cache, P(rows)),
                         out_specs=queries, check_vma=False)(q, k, v, lengths)
