"""Which keys each query may see, as a description that no implementation has to expand.

Glossary of shapes: B batch, L queries, S keys, H heads, and a block of bq queries x bk keys.

A `Mask` says what every family needs from attention: causality, padding, the documents
packed into a row, a sliding window, global tokens (Longformer), a block-sparse pattern
(BigBird) and an additive per-head bias computed from positions (T5's relative buckets, ALiBi's
distances: `alibi.py`).
Query i of L sits at position S - L + i (bottom-right, as decoding and chunked prefill
need) and key j at position j, unless explicit positions are given (a decode ring buffer).
A pair (query, key) is allowed when every given condition holds:

    causal       key position <= query position
    key_valid    [B, S] bool: the key is not padding
    segments     [B, L] and key_segments [B, S]: the same document
    pattern      window (left, right): q - left <= k <= q + right,
                 or either position < global_tokens (sees and is seen by every token),
                 or the pair's blocks are in the block-sparse table
                 (no window and no sparse table: every pair)

`block(...)` computes any block of it from positions and slices of its arrays (the same
code serves the dense reference, whose block is everything); `visible_blocks` says from
the static parts alone which blocks can hold an allowed pair, so blockwise attention
skips the rest.
"""

import dataclasses
import functools
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

FAR = -(2**30)  # the position of an empty decode-cache slot: outside every window


@dataclasses.dataclass(frozen=True)
class BlockSparse:
    """BigBird's pattern over blocks of `block` positions: the first `global_blocks` see and are
    seen by all, each block sees `window_blocks` around it (odd: centred) and `random_blocks`
    more drawn from `seed`."""

    block: int
    global_blocks: int = 1
    window_blocks: int = 3
    random_blocks: int = 2
    seed: int = 0

    def table(self, positions: int) -> np.ndarray:
        """[n, n] bool for the n = ceil(positions / block) blocks: query block row sees key block column."""
        return _sparse_table(self, positions)


@functools.lru_cache(maxsize=8)
def _sparse_table(sparse: BlockSparse, positions: int) -> np.ndarray:
    n = -(-positions // sparse.block)
    i = np.arange(n)
    table = np.abs(i[:, None] - i[None, :]) <= sparse.window_blocks // 2
    table[: sparse.global_blocks], table[:, : sparse.global_blocks] = True, True
    for row in range(sparse.global_blocks, n):
        free = np.flatnonzero(~table[row])
        rng = np.random.default_rng((sparse.seed, row))
        table[row, rng.choice(free, min(sparse.random_blocks, len(free)), replace=False)] = True
    return table


@flax.struct.dataclass
class Bias:
    """An additive per-head bias: `fn(params, q_pos [bq], k_pos [bk]) -> [H, bq, bk]` float32. `per_head`:
    every leaf of `params` is indexed by head on its first axis (ALiBi's slopes [H]), so the bias splits with
    the heads; else (T5's table) `fn` needs the params whole."""

    params: object
    fn: Callable = flax.struct.field(pytree_node=False)
    per_head: bool = flax.struct.field(pytree_node=False, default=False)


@flax.struct.dataclass
class Mask:
    """The description (see the module docstring). Arrays are pytree leaves; the rest is static."""

    causal: bool = flax.struct.field(pytree_node=False, default=False)
    window: tuple[int, int] | None = flax.struct.field(pytree_node=False, default=None)
    global_tokens: int = flax.struct.field(pytree_node=False, default=0)
    sparse: BlockSparse | None = flax.struct.field(pytree_node=False, default=None)
    extent: int = flax.struct.field(pytree_node=False, default=0)  # positions run below max(it, S)
    key_valid: jax.Array | None = None        # [B, S] bool
    segments: jax.Array | None = None         # [B, L] int
    key_segments: jax.Array | None = None     # [B, S] int (None: `segments`, self-attention)
    query_positions: jax.Array | None = None  # [L] int (None: S - L + i)
    key_positions: jax.Array | None = None    # [S] int (None: j)
    bias: Bias | None = None

    @property
    def has_pattern(self) -> bool:
        return self.window is not None or self.sparse is not None

    @property
    def allows_all(self) -> bool:
        """No condition at all (causality aside)."""
        return not self.has_pattern and all(x is None for x in (
            self.key_valid, self.segments, self.key_segments, self.query_positions, self.key_positions, self.bias))

    @property
    def is_plain_causal(self) -> bool:
        """Causal and nothing else: the mask `jax.nn`'s causal kernels and the CPU path's causal blocks know."""
        return self.causal and self.allows_all

    def positions(self, length: int, source_length: int) -> tuple[jax.Array, jax.Array]:
        """Query positions [L] and key positions [S]."""
        q = jnp.arange(length) + (source_length - length) if self.query_positions is None else self.query_positions
        k = jnp.arange(source_length) if self.key_positions is None else self.key_positions
        return q, k

    def block(self, q_pos: jax.Array, k_pos: jax.Array, source_length: int, rows: tuple = (None, None),
              key_in: jax.Array | None = None) -> jax.Array:
        """[B | 1, bq, bk] bool for queries at q_pos [bq] and keys at k_pos [bk] of S = source_length;
        `rows` are the block's (query, key) index slices of the arrays, as (start, size) pairs (None:
        all); `key_in` [bk] marks keys that exist (False: padding a block out)."""
        (qs, ks) = rows
        take = lambda x, r: x if r is None else jax.lax.dynamic_slice_in_dim(x, r[0], r[1], 1)
        key_segments = self.segments if self.key_segments is None else self.key_segments
        documents = self.segments is not None
        allowed = self.pairs(
            q_pos[:, None], k_pos[None, :], source_length, key_in=key_in,
            key_valid=None if self.key_valid is None else take(self.key_valid, ks)[:, None, :],
            q_segments=take(self.segments, qs)[:, :, None] if documents else None,
            k_segments=take(key_segments, ks)[:, None, :] if documents else None)
        return allowed if allowed.ndim == 3 else allowed[None]

    def pairs(self, q: jax.Array, k: jax.Array, source_length: int, *, key_in=None, key_valid=None,
              q_segments=None, k_segments=None, sparse_table: Callable | None = None) -> jax.Array:
        """The allowed pairs [..., bq, bk] bool, broadcast from positions q [bq, 1] and k [1, bk] and the
        arrays' slices: key_valid, k_segments [..., 1, bk], q_segments [..., bq, 1]; key_in [bk] marks keys
        that exist. `sparse_table(rows, cols)` reads the block-sparse table where it may not be a constant
        (a GPU kernel's input). Written with no slicing and no reshape, as a Triton kernel needs."""
        allowed = jnp.ones((q.shape[0], k.shape[1]), bool)
        if key_in is not None:
            allowed &= key_in[None, :]
        if self.causal:
            allowed &= k <= q
        if self.has_pattern:
            allowed &= self._pattern(q, k, source_length, sparse_table)
        if key_valid is not None:
            allowed = allowed & key_valid
        if q_segments is not None:
            allowed = allowed & (q_segments == k_segments)
        return allowed

    def _pattern(self, q: jax.Array, k: jax.Array, source_length: int, sparse_table: Callable | None) -> jax.Array:
        """[bq, bk] bool: in the window, global, or in the sparse table (q [bq, 1], k [1, bk])."""
        g = self.global_tokens
        seen = ((q >= 0) & (q < g)) | ((k >= 0) & (k < g))  # an empty cache slot (FAR) is not global
        if self.window is not None:
            left, right = self.window
            seen |= (k >= q - left) & (k <= q + right)
        if self.sparse is not None:
            n, b = self.sparse_side(source_length), self.sparse.block
            lookup = sparse_table or (
                lambda r, c: jnp.asarray(self.sparse.table(max(source_length, self.extent)))[r, c])
            seen |= lookup(jnp.clip(q // b, 0, n - 1), jnp.clip(k // b, 0, n - 1))
        return seen

    def sparse_side(self, source_length: int) -> int:
        """The side of the block-sparse table a call over S = source_length keys reads."""
        return -(-max(source_length, self.extent) // self.sparse.block)

    def may_pair(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        """Whether queries at q_pos [bq] and keys at k_pos [bk] may hold an allowed pair, judged from the
        positions' ranges (never False where one exists): skips blocks whose positions are arrays."""
        return self.may_pair_ranges(q_pos.min(), q_pos.max(), k_pos.min(), k_pos.max())

    def may_pair_ranges(self, q_lo, q_hi, k_lo, k_hi) -> jax.Array:
        """`may_pair` from the positions' ranges (arrays of any broadcastable shapes: many blocks at once)."""
        possible = jnp.asarray(True)
        if self.causal:
            possible &= k_lo <= q_hi
        if self.window is not None and not self.global_tokens and self.sparse is None:
            left, right = self.window
            possible &= (k_hi >= q_lo - left) & (k_lo <= q_hi + right)
        return possible

    def bias_block(self, q_pos: jax.Array, k_pos: jax.Array, params=None) -> jax.Array | None:
        """[H, bq, bk] float32, or None; `params` replaces the bias's own (for its gradient)."""
        if self.bias is None:
            return None
        return self.bias.fn(self.bias.params if params is None else params, q_pos, k_pos).astype(jnp.float32)

    def dense(self, length: int, source_length: int) -> jax.Array:
        """The whole mask, [B | 1, 1, L, S] bool: the dense reference's (and only its) [L, S] array."""
        q, k = self.positions(length, source_length)
        return self.block(q, k, source_length)[:, None]

    def visible_blocks(self, length: int, source_length: int, bq: int, bk: int) -> np.ndarray:
        """[ceil(L / bq), ceil(S / bk)] bool: the blocks the static parts (causal, window, globals, sparse)
        leave an allowed pair in; every block where positions are explicit."""
        nq, nk = -(-length // bq), -(-source_length // bk)
        if self.query_positions is not None or self.key_positions is not None:
            return np.ones((nq, nk), bool)
        q_lo = source_length - length + np.arange(nq)[:, None] * bq  # [nq, 1]
        q_hi = np.minimum(q_lo + bq, source_length) - 1
        k_lo = np.arange(nk)[None, :] * bk  # [1, nk]
        k_hi = np.minimum(k_lo + bk, source_length) - 1
        seen = np.ones((nq, nk), bool)
        if self.causal:
            seen &= k_lo <= q_hi
        if self.has_pattern:
            pattern = (q_lo < self.global_tokens) | (k_lo < self.global_tokens)
            if self.window is not None:
                left, right = self.window
                pattern |= (k_hi >= q_lo - left) & (k_lo <= q_hi + right)
            if self.sparse is not None:
                pattern |= self._sparse_blocks(q_lo, q_hi, k_lo, k_hi, source_length)
            seen &= pattern
        return seen

    def _sparse_blocks(self, q_lo, q_hi, k_lo, k_hi, source_length: int) -> np.ndarray:
        """[nq, nk]: some pair of the block lies in a sparse-table block."""
        b = self.sparse.block
        table = self.sparse.table(source_length)
        cum = np.pad(table.cumsum(0).cumsum(1), ((1, 0), (1, 0)))  # summed-area table
        r0, r1 = np.maximum(q_lo, 0) // b, np.maximum(q_hi, 0) // b + 1  # [nq, 1]
        c0, c1 = k_lo // b, k_hi // b + 1  # [1, nk]
        return (cum[r1, c1] - cum[r0, c1] - cum[r1, c0] + cum[r0, c0]) > 0

    def computed_pairs(self, length: int, source_length: int, implementation: str, block: int) -> int:
        """The (query, key) pairs an implementation computes scores for: all of them but where
        blockwise skips blocks (for the FLOPs count). Ring attention counts as blockwise: exact where
        a block divides each device's zigzag chunks, whose blocks are then blockwise's."""
        if implementation not in ("blockwise", "ring"):
            return length * source_length
        bq, bk = min(block, length), min(block, source_length)
        return int(self.visible_blocks(length, source_length, bq, bk).sum()) * bq * bk

