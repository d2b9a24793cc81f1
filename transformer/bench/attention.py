"""Time each attention implementation x mask kind, forward and backward, beside its error.

The error is against the dense reference in float32.

  python -m transformer.bench.attention                        # 2,048 and 16,384 tokens
  python -m transformer.bench.attention --lengths 1024 --implementations auto,dense --repeats 3

Shapes: batch 1, 16 query heads, 4 kv heads, head width 64, q, k, v in `--dtype` (bfloat16). A cell
is the median of `--repeats` timed calls of the jitted value-and-gradient of sum(out^2), after two
warm-up calls (the first compiles, and on a GPU autotunes). Its error is the relative L2 distance of
out, dq, dk, dv from dense attention over the same inputs in float32 at the highest matmul precision,
where L <= `--dense_max` (dense holds [H, L, L]). `cudnn` is cuDNN's kernel called through jax.nn
directly, the reference `auto` is held to on a GPU. `path` says what ran on a GPU: cuDNN, or the Pallas
kernel and why not cuDNN (`cudnn.refusal`); on other platforms, the platform.

Masks: `causal`; `window512` (causal, each token sees itself and the 511 before it); `none`;
`documents` (causal within documents packed into the row, their lengths drawn around 1,024 tokens,
as `data.document_mask=true` gives a packed corpus).
"""

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from transformer import cli
from transformer.layers import attention
from transformer.layers.attention import Mask
from transformer.layers.attention.kernels import cudnn

BATCH, HEADS, KV_HEADS, HEAD_DIM = 1, 16, 4, 64
MASKS = ("causal", "window512", "none", "documents")


def make_mask(kind: str, length: int, seed: int = 0) -> Mask:
    """One of MASKS over a row of `length` tokens."""
    if kind == "causal":
        return Mask(causal=True)
    if kind == "window512":
        return Mask(causal=True, window=(511, 0))
    if kind == "none":
        return Mask()
    if kind == "documents":
        sizes = np.maximum(np.random.default_rng(seed).exponential(1024, size=length), 16).astype(int)
        segments = np.repeat(np.arange(length), sizes)[:length]
        return Mask(causal=True, segments=jnp.asarray(segments[None].repeat(BATCH, 0), jnp.int32))
    raise ValueError(f"unknown mask {kind!r}; choose from {', '.join(MASKS)}")


def inputs(length: int, seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B, L, H, Dh], k, v [B, L, K, Dh] float32."""
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (BATCH, length, HEADS, HEAD_DIM), jnp.float32)
    k, v = (jax.random.normal(key, (BATCH, length, KV_HEADS, HEAD_DIM), jnp.float32) for key in keys[1:])
    return q, k, v


def cudnn_reference(q, k, v, mask: Mask) -> jax.Array:
    """cuDNN's kernel called through jax.nn directly: what `auto` is measured against (no mask, causal,
    causal window; it takes no documents)."""
    if not mask.replace(causal=False, window=None).allows_all:
        raise ValueError("jax.nn's cuDNN call takes no document mask")
    window = None if mask.window is None else (mask.window[0], 0)
    return jax.nn.dot_product_attention(q, k, v, is_causal=mask.causal, local_window_size=window,
                                        implementation="cudnn")


def value_and_grads(implementation: str, mask: Mask):
    """The jitted (out, (dq, dk, dv)) of sum(out^2) through `implementation` (or 'cudnn': `cudnn_reference`)."""
    def loss(q, k, v):
        out = (cudnn_reference(q, k, v, mask) if implementation == "cudnn"
               else attention.attend(q, k, v, mask, implementation))
        return jnp.sum(out.astype(jnp.float32) ** 2), out
    grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    return jax.jit(lambda q, k, v: (lambda r: (r[0][1], r[1]))(grads(q, k, v)))


def path(q: jax.Array, k: jax.Array, mask: Mask) -> str:
    """What `auto` and `flash` run for this call here."""
    if jax.default_backend() != "gpu":
        return jax.default_backend()
    reason = cudnn.refusal(q, k, mask)
    return "cudnn" if reason is None else f"pallas ({reason})"


def relative_error(ours, reference) -> float:
    ours, reference = (jnp.asarray(x, jnp.float32) for x in (ours, reference))
    return float(jnp.linalg.norm(ours - reference) / jnp.linalg.norm(reference))


def cell(implementation: str, mask: Mask, q, k, v, repeats: int, reference=None) -> dict:
    """One timed implementation: median ms of forward + backward, and its errors against `reference`."""
    fn = value_and_grads(implementation, mask)
    for _ in range(2):
        result = jax.block_until_ready(fn(q, k, v))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(q, k, v))
        times.append(time.perf_counter() - start)
    row = {"ms": 1e3 * statistics.median(times)}
    if reference is not None:
        names = ("out", "dq", "dk", "dv")
        row |= {name: relative_error(a, b) for name, a, b in zip(names, jax.tree.leaves(result), reference)}
    return row


def table(lengths, implementations, masks=MASKS, dtype: str = "bfloat16", repeats: int = 5,
          dense_max: int = 4096, say=print) -> list[dict]:
    """Every (length, mask, implementation) cell, each said as it is measured."""
    rows = []
    for length in lengths:
        q, k, v = inputs(length, seed=length)
        low = [x.astype(dtype) for x in (q, k, v)]
        for kind in masks:
            mask = make_mask(kind, length)
            reference = None
            if length <= dense_max:
                with jax.default_matmul_precision("highest"):
                    out, grads = value_and_grads("dense", mask)(q, k, v)
                reference = [out, *grads]
            for implementation in implementations:
                if implementation == "dense" and length > dense_max:
                    continue
                row = {"length": length, "mask": kind, "implementation": implementation, "dtype": dtype,
                       "path": path(low[0], low[1], mask) if implementation in ("auto", "flash") else ""}
                try:
                    row |= cell(implementation, mask, *low, repeats, reference)
                except Exception as error:  # a row that fails is a finding, not the end of the table
                    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
                say(format_row(row))
                rows.append(row)
    return rows


def format_row(row: dict) -> str:
    head = f"L={row['length']:6d} {row['mask']:10s} {row['implementation']:9s} {row['dtype']}"
    if "error" in row:
        return f"{head} FAILED {row['error']}"
    errors = " ".join(f"{name} {row[name]:.1e}" for name in ("out", "dq", "dk", "dv") if name in row)
    return f"{head} fwd+bwd {row['ms']:8.2f} ms  {errors}  {row['path']}".rstrip()


FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_list("lengths", ["2048", "16384"], "sequence lengths")
    flags.DEFINE_list("implementations", ["dense", "auto", "blockwise", "flash"], "attention implementations")
    flags.DEFINE_list("masks", list(MASKS), "mask kinds")
    flags.DEFINE_string("dtype", "bfloat16", "q, k, v dtype")
    flags.DEFINE_integer("repeats", 5, "timed calls per cell (after two warm-up calls)")
    flags.DEFINE_integer("dense_max", 4096, "the longest length dense attention runs at (the reference)")
    flags.DEFINE_string("json", "", "also write the rows to this JSON file")


def main(argv) -> None:
    del argv
    print(f"attention on {jax.devices()[0].device_kind} ({jax.default_backend()}), batch {BATCH}, heads {HEADS}, "
          f"kv heads {KV_HEADS}, head width {HEAD_DIM}", flush=True)
    rows = table([int(x) for x in FLAGS.lengths], FLAGS.implementations, FLAGS.masks, FLAGS.dtype, FLAGS.repeats,
                 FLAGS.dense_max, say=lambda line: print(line, flush=True))
    if FLAGS.json:
        with open(FLAGS.json, "w") as out:
            json.dump(rows, out)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
