"""layers/matmul.py: bfloat16 operands, float32 sums, and a backward of row-major dots only (CPU)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from transformer.layers import matmul
from transformer.training import checks

BF16 = jnp.bfloat16

# (x shape, w shape, dimension numbers): a Dense kernel, DenseGeneral's q/k/v [D, H, Dh] and out
# [H, Dh, D] kernels, and a tied head's table [V, D]; "narrow" and "many rows" take the weight
# gradient's other form (the gradient and the product transposed, not x)
CASES = {
    "dense": ((4, 6, 16), (16, 8), (((2,), (0,)), ((), ()))),
    "narrow": ((4, 6, 64), (64, 4), (((2,), (0,)), ((), ()))),
    "heads": ((4, 6, 16), (16, 2, 4), (((2,), (0,)), ((), ()))),
    "out": ((4, 6, 2, 4), (2, 4, 16), (((2, 3), (0, 1)), ((), ()))),
    "table": ((4, 6, 16), (32, 16), (((2,), (1,)), ((), ()))),
    "table, many rows": ((8, 32, 16), (64, 16), (((2,), (1,)), ((), ()))),
}


def operands(x_shape, w_shape, seed=0):
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.normal(size=x_shape), BF16), jnp.asarray(r.normal(size=w_shape), BF16))


@pytest.mark.parametrize("case", sorted(CASES))
def test_values_and_gradients_equal_the_float32_product_of_the_same_operands(case):
    x_shape, w_shape, dims = CASES[case]
    x, w = operands(x_shape, w_shape)
    ours = lambda x, w: matmul.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    reference = lambda x, w: lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), dims)
    np.testing.assert_allclose(ours(x, w), reference(x, w), rtol=1e-5, atol=1e-5)
    g = jnp.asarray(np.random.default_rng(1).normal(size=ours(x, w).shape), jnp.float32)
    grads = jax.grad(lambda x, w: (ours(x, w) * g).sum(), argnums=(0, 1))(x, w)
    expected = jax.grad(lambda x, w: (reference(x, w) * g.astype(BF16).astype(jnp.float32)).sum(),
                        argnums=(0, 1))(x, w)
    for ours_grad, want in zip(grads, expected):
        assert ours_grad.dtype == BF16
        np.testing.assert_allclose(ours_grad.astype(jnp.float32), want.astype(jnp.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("x_shape, w_shape", [((256, 64), (64, 128)), ((256, 128), (128, 16))])
def test_every_dot_of_the_gradient_is_row_major_by_row_major(x_shape, w_shape):
    """The weight gradient x^T g contracts both operands' rows; ours transposes x first, or g and
    the product (the second shape)."""
    x, w = operands(x_shape, w_shape)
    loss = lambda x, w: matmul.dot_general(x, w, (((1,), (0,)), ((), ()))).sum()
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
    dots = re.findall(r"dot\(.*?lhs_contracting_dims=\{(\d+)\}, rhs_contracting_dims=\{(\d+)\}", hlo)
    assert len(dots) >= 2 and all(lhs == "1" for lhs, _ in dots), dots
    plain = jax.jit(jax.grad(lambda x, w: lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                                                          preferred_element_type=jnp.float32).sum(),
                             argnums=(0, 1))).lower(x, w).compile().as_text()
    assert "lhs_contracting_dims={0}" in plain  # what the layout constraint avoids


def test_a_tied_heads_input_gradient_contracts_both_operands_last_dims():
    """dx = g w for a table w [N, K]: w^T is copied, so the dot is the kernel's g [M, N] x [K, N]^T
    (on a 2-core Zen 5, the head's dx 33 -> 25 ms)."""
    x, w = operands((256, 64), (512, 64))
    loss = lambda x: matmul.dot_general(x, w, (((1,), (1,)), ((), ()))).sum()
    hlo = jax.jit(jax.grad(loss)).lower(x).compile().as_text()
    dots = re.findall(r"dot\(.*?lhs_contracting_dims=\{(\d+)\}, rhs_contracting_dims=\{(\d+)\}", hlo)
    assert dots == [("1", "1")], dots


def test_other_dots_and_float32_fall_through_to_lax():
    x, w = operands((2, 3, 8), (2, 8, 5))
    batched = (((2,), (1,)), ((0,), (0,)))
    np.testing.assert_array_equal(matmul.dot_general(x, w, batched), lax.dot_general(x, w, batched))
    x32, w32 = x.astype(jnp.float32)[0], w.astype(jnp.float32)[0]
    dims = (((1,), (0,)), ((), ()))
    np.testing.assert_array_equal(matmul.dot_general(x32, w32, dims), lax.dot_general(x32, w32, dims))
    assert matmul.dot_general_for(jnp.float32) is None
    assert matmul.dot_general_for(BF16) is (matmul.dot_general if jax.default_backend() == "cpu" else None)


@pytest.mark.parametrize("lines, lacks", [
    (["processor\t: 0", "flags\t\t: fpu sse2 avx2 fma"], True),  # an AVX2 AMD EPYC
    (["flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile"], False),  # Sapphire Rapids
    (["flags\t\t: avx2 avx512_bf16"], False),
    (["Features\t: fp asimd bf16"], False),  # Arm: no x86 flags line, cannot tell
])
def test_a_cpu_without_bf16_instructions_is_told_from_its_flags(tmp_path, lines, lacks):
    (tmp_path / "cpuinfo").write_text("\n".join(lines) + "\n")
    assert matmul.cpu_lacks_bf16(str(tmp_path / "cpuinfo")) is lacks
    assert matmul.cpu_lacks_bf16(str(tmp_path / "missing")) is False


@pytest.mark.parametrize("lacks", [True, False])
def test_a_bf16_run_on_such_a_cpu_is_warned_of_its_speed(tmp_path, small_gpt_config, monkeypatch, capsys, lacks):
    from transformer.training import loop
    monkeypatch.setattr(matmul, "cpu_lacks_bf16", lambda: lacks)
    for dtype in ("bfloat16", "float32"):
        config = checks.checked(small_gpt_config(f"model.dtype={dtype}"))
        run = loop.setup(config, str(tmp_path / dtype), jax.devices()[:1])
        run.ckpt.close()
        run.writer.close()
        warned = "this CPU has no bfloat16 instructions" in capsys.readouterr().err
        assert warned is (lacks and dtype == "bfloat16"), dtype
