"""Flash attention on NVIDIA GPUs: one Pallas (Triton) kernel for the whole mask description.

Glossary of shapes: B batch, K kv heads, G = H // K query heads per kv head, Dh head width (Dp padded
to a power of two), tq x tk one tile (queries x keys), nq x nk the tiles, Lq = nq tq and Sk = nk tk
the lengths padded to them; B' is B where the tables depend on the batch's arrays, else 1.

This is blockwise attention's kernel on a GPU (`blockwise.Kernel`): it takes what `blockwise.prepare`
makes (`blockwise.Operands`: q scaled, [B, Lp, K, G, Dh]; k, v [B, Sp, K, Dh]; the mask's padded
arrays; positions) and returns what blockwise's scan does (out float32 and the log-sum-exp; dq, dk,
dv and the bias's gradient), so `blockwise`, `ring` (per hop) and `flash`/`auto` (where cuDNN
declines) all run it on a GPU (`platforms.py` chooses).

- One program holds one tile of queries of one head and runs over the key tiles its row of a
  table lists (`Tables`): the tiles the mask's static parts leave visible (causal, window,
  globals, block-sparse: `Mask.visible_blocks`), less, at run time, those whose positions cannot
  pair (explicit positions: decoding, ring hops), whose keys are all padding, or whose documents
  (segment ids, as ranges per tile) differ from the queries'. A packed row of short documents
  thus costs its documents' tiles, not L^2.
- Inside a tile the mask is `Mask.pairs`, the same code as the reference's, on the tile's
  positions and slices; the block-sparse table is an input read by a gather.
- Grouped kv heads are indexed, never repeated: the G query heads of a kv head read the same
  k, v tiles, and the dk, dv program sums its G heads.
- A per-head bias (T5's) is the one [H, Lq, Sk] float32 array materialised here, computed once
  from its function, read per tile; its gradient is summed over the batch by atomic adds and
  pulled back through the function.
- The backward recomputes each tile's probabilities from the log-sum-exp, in two kernels: dk, dv
  per key tile (over the query tiles a transposed table lists), dq per query tile.

Triton wants power-of-two tiles of at least 16: q, k, v are padded to the tiles (and the head
width to Dp, with zeros, which changes no score) and the outputs cut back. `interpret=True` runs the
same kernels in Pallas's interpreter on any machine: that is how the tests check them on a CPU.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from transformer.layers.attention.blockwise import Operands, Plan
from transformer.layers.attention.masks import FAR, Mask

FORWARD_TILES = (128, 64)  # (tq, tk) of the forward kernel
BACKWARD_TILES = (64, 64)  # of both backward kernels


@dataclasses.dataclass(frozen=True)
class Layout:
    """The static part of one kernel call: tiles, true lengths, query heads per kv head, the mask's
    static fields, the names of the mask's inputs in the kernels' argument order, whether positions
    are explicit (`Plan.dynamic`) and whether the tables depend on the batch's arrays."""

    tq: int
    tk: int
    nq: int
    nk: int
    length: int
    source_length: int
    groups: int
    mask: Mask
    inputs: tuple[str, ...]
    dynamic: bool

    @property
    def batched(self) -> bool:
        return "key_valid" in self.inputs or "segments" in self.inputs


@dataclasses.dataclass(frozen=True)
class Flash:
    """The kernel behind `blockwise.Kernel`'s interface; `interpret` runs it in Pallas's interpreter."""

    interpret: bool = False

    def forward(self, plan: Plan, x: Operands):
        """-> out [B, Lp, K, G, Dh] float32 (0 where a query sees nothing), lse [B, K, G, Lp] (-inf there)."""
        lp, dh = x.q.shape[1], x.q.shape[-1]
        layout, (q, k, v), inputs = _prepare(plan, FORWARD_TILES, x)
        out, lse = _forward_call(layout, q, k, v, inputs, Tables.of(_visible(layout, inputs)), self.interpret)
        return out[:, :lp, ..., :dh], lse[..., :lp]

    def backward(self, plan: Plan, x: Operands, lse, delta, d_out):
        """-> float32 dq [B, Lp, K, G, Dh], dk, dv [B, Sp, K, Dh] and the bias parameters' gradient."""
        lp, sp, dh = x.q.shape[1], x.k.shape[1], x.q.shape[-1]
        layout, (q, k, v, d_out), inputs = _prepare(plan, BACKWARD_TILES, x, d_out)
        pad = lambda y: jnp.pad(y, ((0, 0),) * 3 + ((0, layout.nq * layout.tq - lp),))
        lse = pad(jnp.where(jnp.isfinite(lse), lse, jnp.inf))  # a query that sees nothing: p = 0
        delta = pad(delta)
        visible = _visible(layout, inputs)
        dq = _dq_call(layout, q, k, v, inputs, Tables.of(visible), lse, delta, d_out, self.interpret)
        dk, dv, dbias = _dkv_call(layout, q, k, v, inputs, Tables.of(visible.swapaxes(-1, -2)), lse, delta, d_out,
                                  self.interpret)
        grads = (dq[:, :lp, ..., :dh], dk[:, :sp, ..., :dh], dv[:, :sp, ..., :dh])
        if plan.bias_fn is None:
            return (*grads, None)
        vary = jnp.zeros_like(dbias[(0,) * dbias.ndim])  # the gradient varies where dbias does (shard_map)
        _, pullback = jax.vjp(lambda p: plan.bias_fn(p, inputs["q_pos"], inputs["k_pos"]).astype(jnp.float32),
                              jax.tree.map(lambda p: p.astype(jnp.float32) + vary, x.bias_params))
        dparams = pullback(dbias)[0]
        return (*grads, jax.tree.map(lambda g, p: g.astype(p.dtype), dparams, x.bias_params))


def _tile(n: int, most: int) -> int:
    """The power-of-two tile (16 .. most) for a length n."""
    return min(most, max(16, 1 << (n - 1).bit_length()))


def _prepare(plan: Plan, tiles, x: Operands, *like_q):
    """The layout, q, k, v (and `like_q`: d_out) padded to the tiles and Dp, and the mask's inputs by
    name: positions q_pos [Lq], k_pos [Sk]; key_valid [B, Sk]; segments [B, Lq] and key_segments
    [B, Sk]; the block-sparse table [n, n]; the bias [H, Lq, Sk] float32."""
    q, k, v, arrays = x.q, x.k, x.v, x.arrays
    lp, sp, dh = q.shape[1], k.shape[1], q.shape[-1]
    tq, tk = _tile(lp, tiles[0]), _tile(sp, tiles[1])
    nq, nk = -(-lp // tq), -(-sp // tk)
    lq, sk, dp = nq * tq, nk * tk, _tile(dh, 1 << 16)
    pad = lambda x, size: jnp.pad(x, [(0, 0), (0, size - x.shape[1])] + [(0, 0)] * (x.ndim - 3) + [(0, dp - dh)])
    padded = (pad(q, lq), pad(k, sk), pad(v, sk), *(pad(x, lq) for x in like_q))
    row = lambda x, size, value: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])], constant_values=value)
    inputs = {"q_pos": row(x.q_pos.astype(jnp.int32), lq, 0), "k_pos": row(x.k_pos.astype(jnp.int32), sk, FAR)}
    if arrays.key_valid is not None:
        inputs["key_valid"] = row(arrays.key_valid, sk, False)
    if arrays.segments is not None:
        inputs["segments"] = row(arrays.segments.astype(jnp.int32), lq, -1)
        inputs["key_segments"] = row(arrays.key_segments.astype(jnp.int32), sk, -2)
    if arrays.sparse is not None:
        inputs["sparse"] = jnp.asarray(arrays.sparse.table(max(plan.source_length, arrays.extent)))
    if plan.bias_fn is not None:
        inputs["bias"] = plan.bias_fn(x.bias_params, inputs["q_pos"], inputs["k_pos"]).astype(jnp.float32)
    static = arrays.replace(key_valid=None, segments=None, key_segments=None)
    layout = Layout(tq, tk, nq, nk, plan.length, plan.source_length, q.shape[3], static, tuple(inputs), plan.dynamic)
    return layout, padded, inputs


@dataclasses.dataclass(frozen=True)
class Tables:
    """Which tiles each row of tiles visits: `index` [B', rows, cols] lists each row's visible columns
    first, in order, and `count` [B', rows] says how many (rows are query tiles; transposed, key tiles).
    Numpy constants where only the mask's static parts decide, arrays otherwise."""

    index: jax.Array
    count: jax.Array

    @staticmethod
    def of(visible) -> "Tables":
        """From the visible tiles [B', rows, cols] bool (`_visible`, transposed for key tiles' rows)."""
        xp = np if isinstance(visible, np.ndarray) else jnp
        index = xp.argsort(~visible, axis=-1, stable=True).astype(np.int32)
        return Tables(index, visible.sum(-1).astype(np.int32))


def _visible(layout: Layout, inputs: dict):
    """[B' | 1, nq, nk] bool: the tiles that may hold an allowed pair (never False where one does)."""
    nq, nk, tq, tk = layout.nq, layout.nk, layout.tq, layout.tk
    visible = np.zeros((1, nq, nk), bool)
    static = layout.mask.visible_blocks(layout.length, layout.source_length, tq, tk)  # all True if dynamic
    visible[0, :static.shape[0], :static.shape[1]] = static
    if not (layout.dynamic or layout.batched):
        return visible
    if layout.dynamic:
        q_lo, q_hi = _ranges(inputs["q_pos"], layout.length, nq, tq)
        k_lo, k_hi = _ranges(inputs["k_pos"], layout.source_length, nk, tk)
        visible = visible & layout.mask.may_pair_ranges(q_lo[..., None], q_hi[..., None], k_lo[None], k_hi[None])
    if "key_valid" in inputs:
        visible = visible & inputs["key_valid"].reshape(-1, nk, tk).any(-1)[:, None, :]
    if "segments" in inputs:
        q_lo, q_hi = _ranges(inputs["segments"], layout.length, nq, tq)  # [B, nq]
        k_lo, k_hi = _ranges(inputs["key_segments"], layout.source_length, nk, tk)
        visible = visible & (q_lo[..., None] <= k_hi[:, None]) & (k_lo[:, None] <= q_hi[..., None])
    return visible


def _ranges(x: jax.Array, length: int, n: int, tile: int) -> tuple[jax.Array, jax.Array]:
    """The least and greatest of x [..., n tile] per tile over its first `length` entries: [..., n] each
    (an empty tile: lo > hi)."""
    real = jnp.arange(n * tile) < length
    big = jnp.iinfo(jnp.int32)
    lo = jnp.where(real, x, big.max).reshape(*x.shape[:-1], n, tile).min(-1)
    hi = jnp.where(real, x, big.min).reshape(*x.shape[:-1], n, tile).max(-1)
    return lo, hi


def _mask_specs(layout: Layout, inputs: dict, bias_heads: int | None) -> list:
    """BlockSpecs of the mask's inputs for a grid (tile, batch row, head or kv head c): the bias of head
    c ([Lq, Sk]), or with `bias_heads` the [bias_heads, Lq, Sk] from head c x bias_heads on."""
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    per_row = lambda x: pl.BlockSpec((None, x.shape[-1]), lambda a, b, c: (b, 0))
    specs = {"q_pos": whole, "k_pos": whole, "sparse": whole, "key_valid": per_row, "segments": per_row,
             "key_segments": per_row,
             "bias": lambda x: pl.BlockSpec((bias_heads, *x.shape[1:]), lambda a, b, c: (c, 0, 0))}
    return [specs[name](x) for name, x in inputs.items()]


def _table_specs(layout: Layout, tables: Tables) -> list:
    """The tables, each program given its batch row's (all of them: a row of tiles is read per program)."""
    row = (lambda a, b, c: b) if tables.count.shape[0] > 1 else (lambda a, b, c: 0)
    return [pl.BlockSpec((None, *tables.index.shape[1:]), lambda a, b, c: (row(a, b, c), 0, 0)),
            pl.BlockSpec((None, tables.count.shape[1]), lambda a, b, c: (row(a, b, c), 0))]


def _scores(layout: Layout, refs: dict, q, k, i, j, bias_tile=None):
    """Query tile i x key tile j: the scores [tq, tk] float32, -inf where the mask forbids the pair."""
    s = plgpu.dot(q, k, trans_b=True)
    rows, cols = pl.ds(i * layout.tq, layout.tq), pl.ds(j * layout.tk, layout.tk)
    if bias_tile is not None:
        s = s + bias_tile(rows, cols)
    has = lambda name: name in refs
    allowed = layout.mask.pairs(
        refs["q_pos"][rows][:, None], refs["k_pos"][cols][None, :], layout.source_length,
        key_in=j * layout.tk + jnp.arange(layout.tk) < layout.source_length,
        key_valid=refs["key_valid"][cols][None, :] if has("key_valid") else None,
        q_segments=refs["segments"][rows][:, None] if has("segments") else None,
        k_segments=refs["key_segments"][cols][None, :] if has("segments") else None,
        sparse_table=(lambda r, c: refs["sparse"][r, c]) if has("sparse") else None)
    return jnp.where(allowed, s, -jnp.inf)


def _like(x: jax.Array, shape: tuple) -> jax.ShapeDtypeStruct:
    """A float32 output of `shape` that varies over the mesh axes x does (inside `jax.shard_map`)."""
    return jax.ShapeDtypeStruct(shape, jnp.float32, manual_axis_type=jax.typeof(x).mat)


def _params(dp: int) -> plgpu.CompilerParams:
    """Triton's launch: 4 warps for heads up to 64 wide, 8 beyond (as JAX's own Triton attention)."""
    return plgpu.CompilerParams(num_warps=4 if dp <= 64 else 8, num_stages=2)


def _forward_kernel(q_ref, k_ref, v_ref, *refs, layout: Layout):
    """Program (query tile i, batch row, head): the online softmax over the key tiles of row i."""
    *mask_refs, index_ref, count_ref, out_ref, lse_ref = refs
    m = dict(zip(layout.inputs, mask_refs))
    i, tk = pl.program_id(0), layout.tk
    q = q_ref[...]  # [tq, Dp]
    bias = (lambda r, c: m["bias"][r, c]) if "bias" in m else None

    def body(t, carry):
        acc, top, total = carry
        j = index_ref[i, t]
        cols = pl.ds(j * tk, tk)
        s = _scores(layout, m, q, k_ref[cols, :], i, j, bias)
        new = jnp.maximum(top, s.max(-1))
        safe = jnp.where(new == -jnp.inf, 0.0, new)
        p = jnp.exp(s - safe[:, None])  # [tq, tk]
        scale = jnp.exp(top - safe)
        acc = acc * scale[:, None] + plgpu.dot(p.astype(v_ref.dtype), v_ref[cols, :])
        return acc, new, total * scale + p.sum(-1)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:1], -jnp.inf, jnp.float32),
            jnp.zeros(q.shape[:1], jnp.float32))
    acc, top, total = jax.lax.fori_loop(0, count_ref[i], body, init)
    seen = total > 0
    norm = jnp.where(seen, total, 1.0)
    out_ref[...] = acc / norm[:, None]
    lse_ref[...] = jnp.where(seen, top + jnp.log(norm), -jnp.inf)


def _query_tile_specs(layout: Layout, q, k) -> tuple:
    """The BlockSpecs of a grid (query tile i, batch row b, head h): a q-shaped tile [tq, Dp] of head h,
    the whole k or v [Sk, Dp] of its kv head, and a row of statistics [tq] (lse, delta)."""
    groups, dp = q.shape[3], q.shape[4]
    return (pl.BlockSpec((None, layout.tq, None, None, dp), lambda i, b, h: (b, i, h // groups, h % groups, 0)),
            pl.BlockSpec((None, k.shape[1], None, dp), lambda i, b, h: (b, 0, h // groups, 0)),
            pl.BlockSpec((None, None, None, layout.tq), lambda i, b, h: (b, h // groups, h % groups, i)))


def _forward_call(layout: Layout, q, k, v, inputs: dict, tables: Tables, interpret: bool):
    """q [B, Lq, K, G, Dp], k, v [B, Sk, K, Dp] -> out [B, Lq, K, G, Dp] float32, lse [B, K, G, Lq]."""
    b, lq, kv_heads, groups, dp = q.shape
    q_spec, kv_spec, lse_spec = _query_tile_specs(layout, q, k)
    return pl.pallas_call(
        functools.partial(_forward_kernel, layout=layout),
        grid=(layout.nq, b, kv_heads * groups),
        in_specs=[q_spec, kv_spec, kv_spec, *_mask_specs(layout, inputs, None), *_table_specs(layout, tables)],
        out_specs=[q_spec, lse_spec],
        out_shape=[_like(q, q.shape), _like(q, (b, kv_heads, groups, lq))],
        compiler_params=_params(dp),
        interpret=interpret,
        name="flash_attention_forward",
    )(q, k, v, *inputs.values(), tables.index, tables.count)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, layout: Layout):
    """Program (query tile i, batch row, head): dq of tile i over the key tiles of row i."""
    *mask_refs, index_ref, count_ref, dq_ref = refs
    m = dict(zip(layout.inputs, mask_refs))
    i, tk = pl.program_id(0), layout.tk
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    bias = (lambda r, c: m["bias"][r, c]) if "bias" in m else None

    def body(t, dq):
        j = index_ref[i, t]
        cols = pl.ds(j * tk, tk)
        k = k_ref[cols, :]
        p = jnp.exp(_scores(layout, m, q, k, i, j, bias) - lse[:, None])
        ds = p * (plgpu.dot(do, v_ref[cols, :], trans_b=True) - delta[:, None])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq_ref[...] = jax.lax.fori_loop(0, count_ref[i], body, jnp.zeros(q.shape, jnp.float32))


def _dq_call(layout: Layout, q, k, v, inputs, tables: Tables, lse, delta, d_out, interpret: bool):
    """-> dq [B, Lq, K, G, Dp] float32."""
    b, lq, kv_heads, groups, dp = q.shape
    q_spec, kv_spec, row_spec = _query_tile_specs(layout, q, k)
    return pl.pallas_call(
        functools.partial(_dq_kernel, layout=layout),
        grid=(layout.nq, b, kv_heads * groups),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *_mask_specs(layout, inputs, None),
                  *_table_specs(layout, tables)],
        out_specs=q_spec,
        out_shape=_like(q, q.shape),
        compiler_params=_params(dp),
        interpret=interpret,
        name="flash_attention_dq",
    )(q, k, v, d_out, lse, delta, *inputs.values(), tables.index, tables.count)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, layout: Layout):
    """Program (key tile j, batch row, kv head): dk, dv of tile j over the G heads x the query tiles of
    column j; the bias's gradient added into [G, Lq, Sk] (summed over the batch's programs)."""
    n_mask = len(layout.inputs)
    m, (index_ref, count_ref) = dict(zip(layout.inputs, refs[:n_mask])), refs[n_mask:n_mask + 2]
    dk_ref, dv_ref, *dbias = refs[n_mask + 2 + ("bias" in m):]  # after the bias's zeros, its aliased output
    dbias_ref = dbias[0] if dbias else None
    j, tq = pl.program_id(0), layout.tq
    k, v = k_ref[...], v_ref[...]  # [tk, Dp]
    n = count_ref[j]

    def body(t, carry):
        dk, dv = carry
        g, i = t // n, index_ref[j, t % n]
        rows = pl.ds(i * tq, tq)
        q, do = q_ref[rows, g, :], do_ref[rows, g, :]  # [tq, Dp]
        bias = (lambda r, c: m["bias"][g, r, c]) if "bias" in m else None
        p = jnp.exp(_scores(layout, m, q, k, i, j, bias) - lse_ref[g, rows][:, None])  # [tq, tk]
        ds = p * (plgpu.dot(do, v, trans_b=True) - delta_ref[g, rows][:, None])
        if dbias_ref is not None:
            plgpu.atomic_add(dbias_ref, (g, rows, pl.ds(j * layout.tk, layout.tk)), ds)
        return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True), dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, n * layout.groups, body, (zeros, zeros))
    dk_ref[...], dv_ref[...] = dk, dv


def _dkv_call(layout: Layout, q, k, v, inputs, tables: Tables, lse, delta, d_out, interpret: bool):
    """-> dk, dv [B, Sk, K, Dp] float32 and, with a bias, its gradient [H, Lq, Sk] (else None)."""
    b, lq, kv_heads, groups, dp = q.shape
    q_spec = pl.BlockSpec((None, lq, None, groups, dp), lambda j, b, h: (b, 0, h, 0, 0))
    kv_spec = pl.BlockSpec((None, layout.tk, None, dp), lambda j, b, h: (b, j, h, 0))
    rows_spec = pl.BlockSpec((None, None, groups, lq), lambda j, b, h: (b, h, 0, 0))
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, rows_spec, rows_spec, *_mask_specs(layout, inputs, groups),
                *_table_specs(layout, tables)]
    out_specs = [kv_spec, kv_spec]
    out_shape = [_like(q, k.shape)] * 2
    args = [q, k, v, d_out, lse, delta, *inputs.values(), tables.index, tables.count]
    aliases = {}
    if "bias" in inputs:
        bias_spec = pl.BlockSpec((groups, lq, k.shape[1]), lambda j, b, h: (h, 0, 0))
        in_specs.append(bias_spec)
        out_specs.append(bias_spec)
        out_shape.append(_like(q, inputs["bias"].shape))
        aliases = {len(args): 2}
        args.append(jnp.zeros(inputs["bias"].shape, jnp.float32) + jnp.zeros_like(lse[(0,) * lse.ndim]))
    grads = pl.pallas_call(
        functools.partial(_dkv_kernel, layout=layout),
        grid=(layout.nk, b, kv_heads),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=_params(dp),
        interpret=interpret,
        name="flash_attention_dkv",
    )(*args)
    return (*grads, None) if len(grads) == 2 else tuple(grads)

