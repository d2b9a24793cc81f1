"""Attention on NVIDIA GPUs, checked on a CPU: the Pallas kernel in Pallas's interpreter against the
dense reference (every mask kind, grouped heads, L != S, odd lengths, bfloat16 and float32); `auto`
and a whole GPT train step with document masks lowered for CUDA hold the kernel and compute no
[L, S] array; and the routing, with the platform faked as a GPU: cuDNN for what it takes, the
kernel for the rest, a refusal falling back and said once."""

import contextlib
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_GPT
from jax.sharding import NamedSharding
from test_attention import inputs, mask_kinds, relative_bias, run

from transformer import config as config_lib
from transformer import parallel, sharding
from transformer.layers import attention
from transformer.layers.attention import Bias, Mask, blockwise, platforms
from transformer.layers.attention.kernels import cudnn, pallas_gpu
from transformer.training import checks, loop

INTERPRETED = pallas_gpu.Flash(interpret=True)
TRITON = "__gpu$xla.gpu.triton"


def kernel(q, k, v, mask, block=16):
    return blockwise.attention(q, k, v, mask, block, kernel=INTERPRETED)


CASES = [(kind, lengths) for kind in mask_kinds(1, 1) for lengths in ((53, 53), (37, 53))] + [
    (kind, (197, 197)) for kind in ("causal", "segments", "padding")]  # ViT's length, a packed corpus's masks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind,lengths", CASES, ids=[f"{kind}-{q}x{k}" for kind, (q, k) in CASES])
def test_the_pallas_kernel_equals_dense_forward_and_gradients(kind, lengths, dtype):
    length, source_length = lengths
    q, k, v, bias_params = inputs(length, source_length)
    low = dtype == "bfloat16"
    if low:  # both sides see the same rounded inputs; dense computes from them in float32
        q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    mask = mask_kinds(length, source_length)[kind]
    as_f32 = lambda xs: [x.astype(jnp.float32) for x in xs]
    dense = run(mask, "dense", *as_f32((q, k, v)), bias_params)
    ours = jax.jit(lambda q, k, v, p: run_kernel(mask, q, k, v, p))(q, k, v, bias_params)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), dense, ours):
        if name != "dbias":
            assert b.dtype == q.dtype, name
        b = b.astype(jnp.float32)
        assert np.all(np.isfinite(b)), (kind, name)
        scale = float(jnp.max(jnp.abs(a))) or 1.0
        assert float(jnp.max(jnp.abs(a - b))) <= (2e-2 if low else 1e-5) * scale, (kind, name)
    if kind == "sees-nothing":
        assert float(jnp.max(jnp.abs(ours[0][0]))) == 0.0 and float(jnp.max(jnp.abs(ours[1][0]))) == 0.0


@pytest.mark.parametrize("kind", ["causal", "segments", "bias"])
def test_the_pallas_kernel_with_a_kv_head_per_head_equals_dense(kind):
    """Multi-head attention (T5's, BERT's: G = 1), the bias's gradient among the rest."""
    q, k, v, bias_params = inputs(37, 53)
    k, v = (jnp.concatenate([x, x[:, :, ::-1]], axis=2) for x in (k, v))  # as many kv heads as heads
    mask = mask_kinds(37, 53)[kind]
    dense = run(mask, "dense", q, k, v, bias_params)
    ours = jax.jit(lambda q, k, v, p: run_kernel(mask, q, k, v, p))(q, k, v, bias_params)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), dense, ours):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * (float(jnp.max(jnp.abs(a))) or 1.0), (kind, name)


def run_kernel(mask, q, k, v, bias_params):
    """`run` (test_attention) with the interpreted kernel in place of an implementation name."""
    original = attention.IMPLEMENTATIONS["blockwise"]
    attention.IMPLEMENTATIONS["blockwise"] = kernel
    try:
        return run(mask, "blockwise", q, k, v, bias_params)
    finally:
        attention.IMPLEMENTATIONS["blockwise"] = original


def test_the_kernel_skips_the_tiles_of_other_documents_and_padding():
    """Tiles whose keys are padding or belong to other documents are never visited."""
    length = 512
    segments = jnp.repeat(jnp.arange(4), 128)[None].repeat(2, 0)  # four documents of 128
    valid = jnp.ones((2, length), bool).at[1, 256:].set(False)
    plan = blockwise.Plan(128, 128, length, length, ((0,), (0,)))
    positions = jnp.arange(length)
    arrays = Mask(causal=True, key_valid=valid, segments=segments, key_segments=segments)
    q, kv = jnp.zeros((2, length, 1, 1, 16)), jnp.zeros((2, length, 1, 16))  # [B, L, K, G, Dh], [B, S, K, Dh]
    operands = blockwise.Operands(q=q, k=kv, v=kv, bias_params=None, arrays=arrays, q_pos=positions, k_pos=positions)
    layout, _, ins = pallas_gpu._prepare(plan, (128, 64), operands)
    tables = pallas_gpu.Tables.of(pallas_gpu._visible(layout, ins))
    # query tile i (128) sees the key tiles (64) of its own document up to itself: 2 of 8
    np.testing.assert_array_equal(tables.count[0], [2, 2, 2, 2])
    np.testing.assert_array_equal(tables.index[0, 1, :2], [2, 3])
    np.testing.assert_array_equal(tables.count[1], [2, 2, 0, 0])  # row 1's last documents are padding


H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")


def lower_for_cuda(fn, *args, mesh: jax.sharding.Mesh | None = None) -> str:
    """fn's program lowered for CUDA on this machine, traced for an abstract H100 (what jax 0.11+ needs to
    lower for a GPU without one; jax 0.10 takes it too). With `mesh`, fn is a step built for that mesh: its
    arguments and the sharding context (the step's own, or one active here) move to an abstract mesh of
    the same axes on H100s."""
    axes = (mesh.devices.shape, mesh.axis_names) if mesh is not None else ((1,), ("x",))
    abstract = jax.sharding.AbstractMesh(*axes, (jax.sharding.AxisType.Auto,) * len(axes[1]), abstract_device=H100)
    if mesh is not None:
        on_gpu = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(abstract, x.sharding.spec))
        args = jax.tree.map(lambda x: on_gpu(x) if isinstance(x.sharding, NamedSharding) else x, args)
    context = sharding.sharding_context
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.sharding.use_abstract_mesh(abstract))
        if mesh is not None:
            if sharding.active() is not None:
                stack.enter_context(context(abstract, sharding.active()[1]))
            stack.enter_context(mock.patch.object(sharding, "sharding_context",
                                                  lambda _, rules: context(abstract, rules)))
        return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def computed_square_arrays(text: str, length: int) -> list[str]:
    """The ops of a lowered program that compute a float32 array ending in [length, length], less the
    zeros a differentiated `platform_dependent` fills the other platforms' residuals with (dead once
    XLA compiles: `test_the_other_platforms_residuals_are_gone_once_compiled`)."""
    shape = re.compile(rf"-> tensor<(?:\d+x)*{length}x{length}xf32>$")
    return [line.strip() for line in text.splitlines()
            if shape.search(line.strip()) and " = " in line and "broadcast_in_dim %cst" not in line]


def test_auto_with_documents_lowers_for_cuda_to_the_kernel_forward_and_backward():
    length = 1024
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, length, 8, 64)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(2, length, 2, 64)), jnp.bfloat16) for _ in range(2))
    segments = jnp.asarray(np.sort(rng.integers(0, 6, (2, length)), axis=1))
    loss = lambda q, k, v, s: jnp.sum(attention.attend(q, k, v, Mask(causal=True, segments=s), "auto")
                                      .astype(jnp.float32) ** 2)
    text = lower_for_cuda(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), q, k, v, segments)
    assert TRITON in text
    assert {"flash_attention_forward", "flash_attention_dq", "flash_attention_dkv"} <= set(
        re.findall(r'name = "(flash_attention_\w+)"', text))
    assert computed_square_arrays(text, length) == []
    assert "cudnn" not in text.lower()


def test_a_gpt_train_step_with_document_masks_lowers_for_cuda_to_the_kernel(tmp_path):
    """The whole step, bf16 at 1,024 tokens, on the 8-device data mesh (each device's part of the
    batch in the kernel: `platforms.on_shards`), lowered as eight H100s would run it."""
    config = config_lib.load("configs/gpt.py:tiny", [*SMALL_GPT, "model.max_len=1024", "data.seq_len=1024",
                                                     "data.document_mask=true", "model.dtype=bfloat16"])
    run_ = loop.setup(checks.checked(config), str(tmp_path))
    try:
        batch = run_.place(run_.task.train_batch(0))
        assert "segments" in batch
        text = lower_for_cuda(run_.train_step, run_.state, batch, run_.step_rng, mesh=run_.mesh)
    finally:
        run_.ckpt.close()
        run_.writer.close()
    kernels = re.findall(r'name = "(flash_attention_\w+)"', text)
    assert kernels.count("flash_attention_forward") >= config.model.num_layers and "flash_attention_dkv" in kernels
    assert computed_square_arrays(text, 1024) == []


def test_the_other_platforms_residuals_are_gone_once_compiled():
    """The mirror of the CUDA lowering's zero-filled residuals, compiled here: the GPU branch's (the
    kernel's q, padded from 200 to its tiles, 256) are in the lowered program, not in the compiled one."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 200, 4, 24)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(2, 200, 2, 24)), jnp.bfloat16) for _ in range(2))
    segments = jnp.asarray(np.sort(rng.integers(0, 3, (2, 200)), axis=1))
    loss = lambda q, k, v: jnp.sum(attention.attend(q, k, v, Mask(causal=True, segments=segments), "auto")
                                   .astype(jnp.float32) ** 2)
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v)
    assert "2x256x2x2x24xbf16" in lowered.as_text()
    assert "bf16[2,256,2,2,24]" not in lowered.compile().as_text()


def test_the_kernel_runs_on_each_devices_part_of_the_batch_and_heads():
    """`platforms.on_shards` on the 8 fake devices (data 2 x fsdp 2 x tensor 2) equals dense."""
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "context": 1, "tensor": 2})
    rules = sharding.DEFAULT_RULES
    q, k, v, _ = inputs(40, 40)
    q, k, v = (jnp.concatenate([x, x[::-1]]) for x in (q, k, v))  # a batch of 4: 2 rows a data x fsdp part
    segments = jnp.asarray(np.sort(np.random.default_rng(3).integers(0, 3, (4, 40)), axis=1))
    mask = Mask(causal=True, segments=segments)
    with sharding.sharding_context(mesh, rules):
        ours = jax.jit(lambda q, k, v, m: platforms.on_shards(blockwise.attention, q, k, v, m, block=16,
                                                          kernel=INTERPRETED))(q, k, v, mask)
    np.testing.assert_allclose(ours, attention.attend(q, k, v, mask, "dense"), atol=1e-5)


@pytest.fixture
def fake_gpu(monkeypatch):
    """This process as a GPU with cuDNN: jax.nn's cuDNN call records its arguments and returns zeros."""
    calls = []

    def cudnn_call(q, k, v, **kwargs):
        calls.append((q.shape, k.shape, kwargs))
        return jnp.zeros_like(q)

    monkeypatch.setattr(cudnn, "available", lambda: True)
    monkeypatch.setattr(cudnn, "head_limit", lambda: 256)
    monkeypatch.setattr(cudnn, "_plan_refusal", lambda *args: None)
    monkeypatch.setattr(jax.nn, "dot_product_attention", cudnn_call)
    monkeypatch.setattr(platforms, "platform", lambda: "gpu")
    monkeypatch.setattr(platforms, "_SAID", set())
    return calls


@pytest.mark.parametrize("kind,want", [
    ("none", "cudnn"), ("causal", "cudnn"), ("window", "cudnn"), ("padding", "both"), ("segments", "kernel"),
    ("window+globals", "kernel"), ("block-sparse", "kernel"), ("bias", "kernel"), ("sees-nothing", "both"),
    ("float32", "kernel"), ("L != S causal", "kernel"), ("odd length", "cudnn"),
])
def test_on_a_gpu_each_mask_kind_reaches_cudnn_or_the_kernel(fake_gpu, kind, want):
    length, source_length = (37, 53) if kind == "L != S causal" else (197, 197) if kind == "odd length" else (64, 64)
    q, k, v, table = inputs(length, source_length)
    dtype = jnp.float32 if kind == "float32" else jnp.bfloat16
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    masks = mask_kinds(length, source_length) | {"none": Mask(), "float32": Mask(causal=True),
                                                 "L != S causal": Mask(causal=True), "odd length": Mask(causal=True)}
    mask = masks[kind]
    mask = mask if mask.bias is None else mask.replace(bias=Bias(table, relative_bias))
    calls = fake_gpu
    jaxpr = str(jax.make_jaxpr(lambda q, k, v, m: platforms.gpu(q, k, v, m, name="auto"))(q, k, v, mask))
    reached = {"cudnn"} if calls else set()
    reached |= {"kernel"} if "pallas_call" in jaxpr else set()
    assert reached == ({"cudnn", "kernel"} if want == "both" else {want})
    if want == "both":  # key padding: cuDNN's sequence lengths where the valid keys come first, on the device
        assert "cond" in jaxpr and calls[0][2]["key_value_seq_lengths"] is not None
    if kind == "odd length":  # padded to even, the extra key left out by the lengths
        assert calls[0][0][1] == 198 and calls[0][2]["key_value_seq_lengths"] is not None
    if kind == "window":
        assert calls[0][2]["is_causal"] and calls[0][2]["local_window_size"] == (5, 0)


def test_on_a_gpu_a_refusal_of_cudnns_falls_to_the_kernel_and_is_said_once(fake_gpu, monkeypatch, capsys):
    q, k, v = (x.astype(jnp.bfloat16) for x in inputs(64, 64)[:3])
    monkeypatch.setattr(cudnn, "_plan_refusal", lambda *args: "cuDNN could not build a plan for q (2, 64, 4, 8)")
    for _ in range(2):
        jaxpr = jax.make_jaxpr(lambda *a: platforms.gpu(*a, name="auto"))(q, k, v, Mask(causal=True))
        assert "pallas_call" in str(jaxpr)
    assert capsys.readouterr().err.count("could not build a plan") == 1
    monkeypatch.setattr(cudnn, "_plan_refusal", lambda *args: None)

    def refuses(q, k, v, **kwargs):
        raise NotImplementedError("Unsupported sequence length Q 64, KV 64.")

    monkeypatch.setattr(jax.nn, "dot_product_attention", refuses)
    assert "pallas_call" in str(jax.make_jaxpr(lambda *a: platforms.gpu(*a, name="flash"))(q, k, v, Mask(causal=True)))
    assert "model.attention=flash: cuDNN refused it (NotImplementedError: Unsupported sequence length" in \
        capsys.readouterr().err


def test_off_a_gpu_the_gpu_branch_traces_the_kernel_and_says_nothing(monkeypatch, capsys):
    monkeypatch.setattr(platforms, "_SAID", set())
    q, k, v, _ = inputs(16, 16)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    assert cudnn.refusal(q, k, Mask(causal=True)) == "no cuDNN here"
    assert "pallas_call" in str(jax.make_jaxpr(lambda *a: platforms.gpu(*a))(q, k, v, Mask(causal=True)))
    assert capsys.readouterr().err == ""
