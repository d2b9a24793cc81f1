"""Ring attention over the mesh's context axis (8 fake devices): the attention alone against dense,
a GPT's training losses against one device's, the zigzag order, and what the compiled step sends."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_GPT
from test_attention import inputs, mask_kinds, run
from test_scale import train_losses

from transformer import config as config_lib
from transformer import parallel, sharding
from transformer.layers import attention
from transformer.layers.attention import Bias, Mask, platforms, ring
from transformer.layers.attention.kernels import splash
from transformer.training import checks, loop

MESHES = {"context=8": dict(data=1, context=8), "data=2,context=4": dict(data=2, context=4),
          "fsdp=2,context=2,tensor=2": dict(data=1, fsdp=2, context=2, tensor=2)}


def mesh_of(sizes: dict):
    mesh_config = config_lib.mesh_config()
    mesh_config.update(sizes)
    return parallel.make_mesh(mesh_config), sharding.rules_of(mesh_config)


def run_on(mesh, rules, mask, q, k, v, bias_params):
    with sharding.sharding_context(mesh, rules):
        return run(mask, "ring", q, k, v, bias_params)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_ring_equals_dense_forward_and_gradients(mesh_name):
    mesh, rules = mesh_of(MESHES[mesh_name])
    q, k, v, bias_params = inputs(64, 64)
    kinds = mask_kinds(64, 64)
    if mesh_name != "context=8":
        kinds = {name: kinds[name] for name in ("causal", "window", "segments", "sees-nothing")}
    for kind, mask in kinds.items():
        dense = run(mask, "dense", q, k, v, bias_params)
        ringed = run_on(mesh, rules, mask, q, k, v, bias_params)
        for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), dense, ringed):
            assert np.all(np.isfinite(b)), (kind, name)
            scale = float(jnp.max(jnp.abs(a))) or 1.0
            assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * scale, (mesh_name, kind, name)


def test_a_bias_with_heads_split_over_tensor_is_refused():
    mesh, rules = mesh_of(MESHES["fsdp=2,context=2,tensor=2"])
    q, k, v, bias_params = inputs(16, 16)
    mask = Mask(causal=True, bias=Bias(bias_params, lambda p, qp, kp: jnp.zeros((4, qp.size, kp.size))))
    with sharding.sharding_context(mesh, rules), pytest.raises(ValueError, match="config.mesh.tensor=1"):
        attention.attend(q, k, v, mask, "ring")


def test_zigzag_gives_device_d_chunks_d_and_2n_minus_1_minus_d():
    order = ring.zigzag(16, 4)  # 8 chunks of 2
    np.testing.assert_array_equal(order.reshape(4, 4), [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                                        [6, 7, 8, 9]])
    with pytest.raises(ValueError, match="2 x 4 chunks"):
        ring.zigzag(12, 4)


def gpt_config(small_gpt_config, *overrides):
    return small_gpt_config("model.attention=ring", "model.attention_block=4", "model.positions=rotary",
                            "model.dropout=0.0", *overrides)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, small_gpt_config):
    """window -> the ring GPT's train losses on one device, each trained once."""
    runs = {}

    def losses(window: int):
        if window not in runs:
            runs[window], _ = train_losses(gpt_config(small_gpt_config, f"model.window={window}"),
                                           tmp_path_factory.mktemp("one"), jax.devices()[:1])
        return runs[window]
    return losses


@pytest.mark.parametrize("mesh_name, window", [("context=8", 0), ("context=8", 5), ("data=2,context=4", 5),
                                               ("fsdp=2,context=2,tensor=2", 0)])
def test_a_gpt_on_a_context_axis_trains_as_on_one_device(tmp_path, small_gpt_config, one_device, mesh_name,
                                                         window):
    assert "data.seq_len=16" in SMALL_GPT  # 2 x 8 chunks of 1 on the widest ring
    one = one_device(window)
    sizes = [f"mesh.{axis}={size}" for axis, size in MESHES[mesh_name].items()]
    config = gpt_config(small_gpt_config, f"model.window={window}", *sizes)
    losses, _ = train_losses(config, tmp_path / "ring")
    np.testing.assert_allclose(losses, one, rtol=1e-5, err_msg=mesh_name)


def compiled_step(tmp_path, config) -> str:
    run_ = loop.setup(checks.checked(config), str(tmp_path))
    try:
        return run_.compiled_step.as_text()
    finally:
        run_.ckpt.close()
        run_.writer.close()


def test_the_ring_step_permutes_keys_and_values_and_never_gathers_them(tmp_path, small_gpt_config):
    """Dense attention on the same mesh all-gathers the keys and values into [B, S, K, Dh]; the ring never."""
    gathered = lambda hlo: [list(map(int, shape.split(","))) for shape in
                            re.findall(r"= \w+\[([\d,]+)\]\S* all-gather(?:-start)?\(", hlo)]
    config = gpt_config(small_gpt_config, "mesh.data=1", "mesh.context=8")
    m = config.model
    keys = [config.data.batch_size, config.data.seq_len, m.num_heads, m.d_model // m.num_heads]
    config.unlock()
    config.model.attention = "dense"
    assert keys in gathered(compiled_step(tmp_path / "dense", config))
    config.model.attention = "ring"
    hlo = compiled_step(tmp_path / "ring", config)
    assert "collective-permute" in hlo
    assert keys not in gathered(hlo)


def test_flash_runs_blockwise_where_no_kernel_takes_the_call_and_says_so_once(capsys, monkeypatch):
    monkeypatch.setattr(platforms, "_SAID", set())  # what this process has said already (other tests run flash)
    q, k, v, _ = inputs(16, 16)
    mask = Mask(causal=True, window=(3, 0))
    out = attention.attend(q, k, v, mask, "flash", block=4)
    np.testing.assert_allclose(out, attention.attend(q, k, v, mask, "dense"), atol=1e-5)
    attention.attend(q, k, v, mask, "flash", block=4)
    assert capsys.readouterr().err.count("no flash kernel on cpu; using blockwise") == 1


def test_a_sequence_that_does_not_zigzag_fails_naming_the_keys(small_gpt_config):
    config = gpt_config(small_gpt_config, "mesh.data=1", "mesh.context=8", "data.seq_len=24")
    with pytest.raises(ValueError, match=r"config.data.seq_len=24 must be a multiple of 2 x config.mesh.context"):
        checks.validate(config)


@pytest.mark.parametrize("mask", [Mask(), Mask(causal=True), Mask(causal=True, window=(31, 0)), Mask(window=(16, 8))],
                         ids=["full", "causal", "causal-window", "window"])
def test_splash_attention_equals_dense_in_pallas_interpret_mode(mask):
    """TPU's flash kernel, run by the Pallas interpreter on CPU, grouped kv heads: outputs and dq."""
    q, k, v, _ = inputs(256, 256)
    assert splash.refusal(q, k, mask) is None
    loss = lambda f: lambda q: jnp.sum(jnp.sin(f(q)))
    ours = jax.value_and_grad(loss(lambda q: splash.attention(q, k, v, mask, interpret=True)))(q)
    dense = jax.value_and_grad(loss(lambda q: attention.attend(q, k, v, mask, "dense")))(q)
    for a, b in zip(ours, dense):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
    assert "multiples of 128" in splash.refusal(q[:, :100], k[:, :100], mask)
