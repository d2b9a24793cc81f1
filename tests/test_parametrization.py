"""muP and CompleteP (layers/parametrization.py): the scales they set, the optimizers' multipliers, the
refusals, and the coordinate check at CI size (probe/coords.py)."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import config as config_lib
from transformer import models
from transformer.interop import hf
from transformer.interop.hf_families import Unsupported
from transformer.layers.attention import MultiHeadAttention
from transformer.layers.parametrization import Parametrization, check_same, lr_multiplier
from transformer.probe import coords, plots
from transformer.training import optim

TINY = "configs/gpt.py:tiny,model.num_layers=1,model.vocab_size=256"


def _model(arg: str):
    return models.build(config_lib.load(f"{TINY},{arg}").model)


def test_mup_init_shrinks_hidden_kernels_only_and_sp_is_the_family_own():
    sp = _model("model.d_model=64,model.mlp_dim=256")
    mup = _model("model.d_model=64,model.mlp_dim=256,model.parametrization=mup,model.mup_base_width=16")
    init = lambda m: m.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]  # noqa: E731
    a, b = nn.meta.unbox(init(sp)), nn.meta.unbox(init(mup))
    up = lambda p: np.asarray(p["block_0"]["mlp"]["up"]["kernel"])  # noqa: E731
    np.testing.assert_allclose(up(b), up(a) * 0.5, rtol=1e-6)  # m = 4: std x m^-1/2, the same draws
    np.testing.assert_array_equal(np.asarray(b["embed"]["embedding"]), np.asarray(a["embed"]["embedding"]))
    assert sp.scaling == Parametrization()


def test_lr_multipliers_are_one_over_m_for_hidden_matrices():
    assert lr_multiplier(["block_0", "mlp", "up", "kernel"], 2, 4.0) == 0.25
    assert lr_multiplier(["blocks", "block", "self_attn", "query", "kernel"], 4, 4.0) == 0.25
    assert lr_multiplier(["block_0", "mlp", "up", "bias"], 1, 4.0) == 1.0
    for path in (["embed", "embedding"], ["unembed", "kernel"], ["head", "kernel"], ["final_norm", "scale"]):
        assert lr_multiplier(path, 2, 4.0) == 1.0


@pytest.mark.parametrize("optimizer", ["adamw", "lion"])
def test_mup_scales_the_hidden_update_by_one_over_m(optimizer):
    c = config_lib.optim_config(optimizer=optimizer, lr=1e-2, warmup_steps=0, schedule="constant", clip_norm=0.0,
                                weight_decay=0.0)
    params = {"block_0": {"mlp": {"up": {"kernel": jnp.ones((4, 8)), "bias": jnp.ones(8)}}}}
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.3), params)
    moved = {}
    for mult in (None, 4.0):
        tx, _ = optim.make_optimizer(c, 10, width_mult=mult)
        moved[mult], _ = tx.update(grads, tx.init(params), params)
    up = moved[None]["block_0"]["mlp"]["up"]
    np.testing.assert_allclose(moved[4.0]["block_0"]["mlp"]["up"]["kernel"], up["kernel"] / 4, rtol=1e-6)
    np.testing.assert_allclose(moved[4.0]["block_0"]["mlp"]["up"]["bias"], up["bias"], rtol=1e-6)


def test_muon_under_mup_scales_by_fan_out_over_fan_in():
    update = {"block_0": {"mlp": {"up": {"kernel": jnp.ones((4, 16))}}}}
    scaled, _ = optim.scale_by_shape(0.2, mup=True).update(update, None)
    np.testing.assert_allclose(scaled["block_0"]["mlp"]["up"]["kernel"], math.sqrt(16 / 4))


def test_mup_refusals_are_one_line():
    with pytest.raises(ValueError, match="mup_base_width"):
        _model("model.parametrization=mup")
    with pytest.raises(ValueError, match="adafactor has no muP"):
        optim.make_optimizer(config_lib.optim_config(optimizer="adafactor"), 10, width_mult=2.0)
    mup = config_lib.load(f"{TINY},model.parametrization=mup,model.mup_base_width=64").model
    sp = config_lib.load(TINY).model
    with pytest.raises(ValueError, match="config.init_from=RUN was trained with model.parametrization=sp") as e:
        check_same(sp, mup, "config.init_from=RUN")
    assert "\n" not in str(e.value)
    check_same(mup, mup, "config.init_from=RUN")
    with pytest.raises(Unsupported, match="parametrization=mup"):
        hf.export_class(mup.to_dict())


def test_attention_scale_is_what_q_dot_k_is_multiplied_by():
    x = jax.random.normal(jax.random.key(1), (1, 5, 16))
    fields = dict(num_heads=2, head_dim=8, attention="dense")
    base = MultiHeadAttention(**fields)
    params = base.init(jax.random.key(0), x)
    inverse = MultiHeadAttention(**fields, scale=1 / 8).apply(params, x)  # q.k / Dh
    query = jax.tree.map(lambda w: w / math.sqrt(8), params["params"]["query"])  # the same, by a smaller query
    expected = base.apply({"params": {**params["params"], "query": query}}, x)
    np.testing.assert_allclose(inverse, expected, rtol=1e-5, atol=1e-6)


def test_completep_scales_residual_branches_by_base_depth_over_depth():
    p = Parametrization("mup", 16, 2)
    fields = p.block_fields(64, 8, {"head_dim": 16, "kernel_init": nn.initializers.normal(0.02),
                                    "out_kernel_init": nn.initializers.normal(0.001)}, init_shrinks=False)
    assert fields["residual_scale"] == 0.25 and fields["attention_scale"] == 1 / 16
    assert fields["out_kernel_init"] is None  # the depth rule is the multiplier, not GPT-2's init
    with pytest.raises(ValueError, match="mup_base_depth"):
        Parametrization("sp", 0, 2).check()


def test_coordinate_check_is_flat_under_mup_and_grows_under_sp():
    config = config_lib.load(f"{TINY},model.num_heads=2,optim.lr=1e-2")
    check = coords.coordinate_check(config, (8, 128), steps=3, batch=2, length=8)  # 16x the width
    hidden = [layer for layer in check.layers if layer != "logits"]
    mup, sp = check.spread("mup"), check.growth("sp")
    assert all(mup[layer] < 2 for layer in hidden), mup
    assert max(sp[layer] for layer in hidden) > 2, sp


def test_the_coordinate_check_figure_draws_every_layer(tmp_path, monkeypatch):
    table = {level: {layer: [[1.0, 2.0], [1.5, 2.5]] for layer in ("embed", "logits")} for level in coords.LEVELS}
    check = coords.Check((8, 128), 2, ("embed", "logits"), {"sp": table, "mup": table})
    assert check.growth("sp")["embed"] == 1.25 and check.spread("mup", "update", 0)["logits"] == 1.5
    drawn, save = [], plots.save
    monkeypatch.setattr(plots, "save", lambda fig, path: drawn.append(fig) or save(fig, path))
    path = coords.figure(str(tmp_path / "coords.png"), check, "a coordinate check")
    assert (tmp_path / "coords.png").stat().st_size > 0 and path.endswith("coords.png")
    lines = [len(ax.get_lines()) for ax in drawn[0].axes]  # rows: sp, mup activations; sp, mup updates
    assert lines == [2] * 4 + [1] * 4, lines  # a line per step; an update from step 1
