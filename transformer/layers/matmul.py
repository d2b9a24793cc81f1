"""Low-precision matmuls for CPU: bfloat16 operands, float32 accumulation, fast backward layouts.

Glossary of shapes: M rows (every leading dim of x flattened), K contracted, N output features.

`dot_general_for(dtype)` is what the layers give Flax's Dense/DenseGeneral (and the tied head):
None (Flax's own `lax.dot_general`) unless the compute dtype is bfloat16 or float16 on a CPU
backend, where it returns `dot_general` below. There XLA's plain low-precision dot takes a
slow path (operands widened to float32, Eigen), and the weight gradient x^T g, which contracts
the rows of both operands, is a "transposed-lhs" dot that XLA:CPU's fast kernels (YNNPACK,
on AMX where the CPU has it) do not take. `dot_general` asks for float32 accumulation
(`preferred_element_type`), and its backward physically transposes an operand of the weight
gradient (a layout constraint, which XLA cannot fold back into the dot): x, or the gradient and
then the product, whichever copies fewer bytes; so every one of the three dots of a dense layer is
a row-major x row-major one. The product is returned in float32
(unless asked otherwise): the bias, activation and norm that follow run in float32, which XLA:CPU
computes natively (bf16 elementwise work is widened there anyway, and a bf16 bias gradient became
a slow tree reduction); the next layer rounds its input to bf16. Gradients are rounded to bf16 at
each dot, as under PyTorch's autocast, and reach the float32 parameters through the cast Flax
applies to the kernel.

Float32 models never take this path. A CPU without bfloat16 instructions runs it slower than
float32; the training loop says so (`cpu_lacks_bf16`). Its speed is measured in
experiments/bench/RESULTS.md.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint

LOW_PRECISION = (jnp.bfloat16, jnp.float16)


def cpu_lacks_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU is known to have no bfloat16 instructions (Linux x86: neither avx512_bf16
    nor amx_bf16 among its flags). XLA:CPU then widens bfloat16 work to float32 on top of the
    conversions, and a bfloat16 model trains slower than a float32 one. False where it cannot tell."""
    try:
        with open(cpuinfo) as f:
            flags = next((line for line in f if line.startswith("flags")), None)
    except OSError:
        return False
    return flags is not None and not {"avx512_bf16", "amx_bf16"} & set(flags.split())


def low_precision(dtype) -> bool:
    """Whether `dtype` is bf16/f16 (LOW_PRECISION)."""
    return jnp.dtype(dtype) in map(jnp.dtype, LOW_PRECISION)


def low_precision_on_cpu(dtype) -> bool:
    """Whether `dtype` is bf16/f16 and JAX computes on the CPU: where this module's paths apply."""
    return low_precision(dtype) and jax.default_backend() == "cpu"


def dot_general_for(dtype) -> object | None:
    """The dot_general for Flax layers computing in `dtype`: `dot_general` for bf16/f16 on CPU, else None."""
    return dot_general if low_precision_on_cpu(dtype) else None


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None) -> jax.Array:
    """`lax.dot_general` with float32 accumulation and CPU-friendly gradients.

    Takes x [M..., K...] against a kernel [K..., N...] (Dense) or a table [N..., K...] (a tied
    output projection), no batch dims, both operands in one low-precision dtype; anything else
    goes to `lax.dot_general` unchanged. Returns [M..., N...] in `preferred_element_type`
    (default: float32).
    """
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    k = len(lhs_contract)
    kernel = tuple(rhs_contract) == tuple(range(k))
    table = tuple(rhs_contract) == tuple(range(rhs.ndim - k, rhs.ndim))
    if (lhs_batch or rhs_batch or tuple(lhs_contract) != tuple(range(lhs.ndim - k, lhs.ndim))
            or not (kernel or table) or lhs.dtype != rhs.dtype
            or not low_precision(lhs.dtype)):
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type=preferred_element_type)
    features = math.prod(lhs.shape[lhs.ndim - k:])
    n_shape = rhs.shape[k:] if kernel else rhs.shape[:rhs.ndim - k]
    w = rhs.reshape(features, -1) if kernel else rhs.reshape(-1, features)  # [K, N] | [N, K]
    out = _matmul(lhs.reshape(-1, features), w, not kernel, jnp.dtype(preferred_element_type or jnp.float32))
    return out.reshape(lhs.shape[:lhs.ndim - k] + n_shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x: jax.Array, w: jax.Array, table: bool, out_dtype) -> jax.Array:
    """x [M, K] @ (w [K, N], or w [N, K] transposed when `table`) -> [M, N] in out_dtype, float32 sums."""
    return lax.dot_general(x, w, (((1,), (1 if table else 0,)), ((), ())),
                           preferred_element_type=jnp.float32).astype(out_dtype)


def _matmul_fwd(x, w, table, out_dtype):
    return _matmul(x, w, table, out_dtype), (x, w)


def _matmul_bwd(table, out_dtype, residuals, g):
    """g [M, N] -> (dx [M, K], dw like w): three row-major dots."""
    x, w = residuals
    g = g.astype(x.dtype)
    kernel = _transposed(w) if table else w  # [K, N]: a table [N, K] copied, so dx contracts both last dims
    dx = lax.dot_general(g, kernel, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    dw = _rows_contracted(g, x) if table else _rows_contracted(x, g)  # like w: [N, K] | [K, N]
    return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _rows_contracted(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, P], b [M, Q] -> a^T b [P, Q] in float32 by a row-major dot: a^T materialised, or b^T
    and the product's transpose, whichever copies fewer bytes (the head's weight gradient: x [M, D]
    and [D, V] rather than the [M, V] gradient of the logits)."""
    (m, p), q = a.shape, b.shape[1]
    if m * p <= m * q + 2 * p * q:  # bytes: a^T in a's dtype | b^T, then the float32 product
        return jnp.dot(_transposed(a), b, preferred_element_type=jnp.float32)
    return _transposed(row_major(jnp.dot(_transposed(b), a, preferred_element_type=jnp.float32)))


def _transposed(a: jax.Array) -> jax.Array:
    """a [R, C] -> a^T [C, R] stored row-major: a copy, not a transposed view the dot would fold in."""
    return row_major(a.T)


def row_major(a: jax.Array) -> jax.Array:
    """a stored row-major (XLA:CPU's fast dots take no other layout): a transposed view becomes a copy."""
    return with_layout_constraint(a, Layout(major_to_minor=tuple(range(a.ndim))))
