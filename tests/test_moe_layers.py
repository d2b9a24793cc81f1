"""A mixture of experts in some layers (model.moe_every, dense_first): which layers hold it, the parameter
tree and its counts (total, active, matmul, FLOPs) against a hand count, the router losses averaged over
the mixture layers alone, the scanned stack's refusal, the checks of the keys, Muon on a mixed stack, and a
few training steps of tiny-moe with every other layer a mixture."""

import json
import math
import os

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import REPO

from transformer import config as config_lib
from transformer import models
from transformer.layers import moe
from transformer.layers.moe import mixture_layers
from transformer.models import common, summary
from transformer.training import loop, optim, shapes

E, K, N, D, F, FE, L, V = 4, 2, 4, 32, 64, 16, 16, 256  # experts, k, layers, widths, length, vocab (bytes)


def mixed_config(*overrides):
    """tiny-moe shrunk: N layers of width D, dense mlps of F, E experts of FE, with `overrides`."""
    return shapes.resolved(config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny-moe"), [
        f"model.num_layers={N}", f"model.d_model={D}", "model.num_heads=4", f"model.mlp_dim={F}",
        f"model.moe_mlp_dim={FE}", f"model.num_experts={E}", f"model.experts_per_token={K}", f"model.max_len={L}",
        f"data.seq_len={L}", *overrides]))


def init_params(model, seed=0):
    return nn.unbox(model.init(jax.random.key(seed), np.zeros((2, L), np.int32))["params"])


@pytest.mark.parametrize("every, first, expected", [
    (1, 0, [1, 1, 1, 1, 1, 1]),  # Mixtral, Qwen3-MoE
    (2, 0, [0, 1, 0, 1, 0, 1]),  # Llama 4's interleave_moe_layer_step=2, Qwen3-MoE's decoder_sparse_step=2
    (1, 3, [0, 0, 0, 1, 1, 1]),  # DeepSeek-V3's first_k_dense_replace=3
    (2, 2, [0, 0, 0, 1, 0, 1]),
    (4, 0, [0, 0, 0, 1, 0, 0]),
])
def test_the_layers_that_hold_the_mixture(every, first, expected):
    assert mixture_layers(6, every, first) == [bool(x) for x in expected]


@pytest.mark.parametrize("every, first, dense, expected", [
    (1, 0, "1", [1, 0, 1, 1]),      # Qwen3-MoE's mlp_only_layers=[1]: layers 0, 2 and 3 sparse
    (1, 0, "(0,3)", [0, 1, 1, 0]),  # as the config's arg writes a list
    (2, 0, "3", [0, 1, 0, 0]),
])
def test_dense_layers_keep_a_dense_mlp_and_the_mixtures_params_sit_elsewhere(every, first, dense, expected):
    assert mixture_layers(4, every, first, dense) == [bool(x) for x in expected]
    config = mixed_config(f"model.moe_every={every}", f"model.dense_layers={dense}")
    params = nn.unbox(models.param_shapes(config.model))
    ups = [params[f"block_{i}"]["mlp"]["up"] for i in range(N)]
    assert [getattr(up, "shape", None) == (E, D, FE) for up in ups] == [bool(x) for x in expected]


@pytest.mark.parametrize("every, first", [(2, 0), (1, 1), (2, 2)])
def test_a_mixed_stack_counts_against_a_hand_count_and_its_parameter_tree(every, first):
    config = mixed_config(f"model.moe_every={every}", f"model.dense_first={first}")
    params = init_params(models.build(config.model))
    mixtures = mixture_layers(N, every, first)
    m = sum(mixtures)
    for i, mixture in enumerate(mixtures):
        mlp = params[f"block_{i}"]["mlp"]
        assert (mlp["up"].shape if mixture else mlp["up"]["kernel"].shape) == ((E, D, FE) if mixture else (D, F))

    attention = 4 * D * D + 4 * D  # q, k, v, out and their biases
    norms = 2 * 2 * D  # two layernorms (scale, bias) a layer
    dense = 2 * D * F + F + D
    experts = E * (2 * D * FE + FE + D)
    s = summary.summarize(config)
    total = V * D + L * D + 2 * D + N * (attention + norms) + (N - m) * dense + m * (D * E + experts)
    assert s["total"] == total == sum(x.size for x in jax.tree.leaves(params))
    assert s["active"] == total - m * experts * (E - K) // E
    matmul = V * D + N * 4 * D * D + (N - m) * 2 * D * F + m * (D * E + K * 2 * D * FE)
    assert s["matmul"] == matmul
    assert s["forward_flops"] == 2 * matmul + 4 * N * D * L
    kinds = {r.kind: r.count for r in s["rows"]}
    assert kinds["mlp up"] == N - m and kinds["expert up"] == kinds["router"] == m


def test_the_router_losses_average_over_the_mixture_layers_alone():
    model = models.build(mixed_config("model.moe_every=2").model)
    tokens = jax.random.randint(jax.random.key(1), (2, L), 0, V)
    params = init_params(model)
    _, state = model.apply({"params": params}, tokens, mutable=[moe.COLLECTION])
    assert sorted(state[moe.COLLECTION]) == ["block_1", "block_3"]
    with common.sowing() as found:
        model.apply({"params": params}, tokens)
    aux = moe.collect(found)
    layers = [state[moe.COLLECTION][b]["mlp"] for b in ("block_1", "block_3")]
    assert aux["load"].shape == (2, E)
    for name in ("load_balance", "router_z"):
        assert float(aux[name]) == pytest.approx(np.mean([float(x[name][0]) for x in layers]))


def test_a_scanned_stack_of_mixed_layers_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^config.model.scan_layers=True repeats one layer, but moe_every=2, "
                                         r"dense_first=0 and dense_layers='' mix dense and mixture-of-experts "
                                         r"layers: set config.model.scan_layers=False"):
        models.param_shapes(mixed_config("model.moe_every=2", "model.scan_layers=True").model)
    scanned = nn.unbox(models.param_shapes(mixed_config("model.scan_layers=True").model))
    assert scanned["blocks"]["block"]["mlp"]["up"].shape == (N, E, D, FE)


@pytest.mark.parametrize("overrides, message", [
    (["model.moe_every=0"], "config.model.moe_every=0 must be >= 1"),
    (["model.dense_first=-1"], "config.model.dense_first=-1 must be >= 0"),
    (["model.dense_first=4"], "config.model.dense_first=4, moe_every=1 and dense_layers='' leave none of the "
                              "num_layers=4 Blocks"),
    (["model.moe_every=5"], "config.model.dense_first=0, moe_every=5 and dense_layers='' leave none of the "
                            "num_layers=4 Blocks"),
    (["model.dense_layers=0,1,2,3"], "config.model.dense_first=0, moe_every=1 and dense_layers='0,1,2,3' leave none"),
    (["model.dense_layers=1,4"], r"config.model.dense_layers='1,4': layer 4 is not among the num_layers=4 Blocks"),
    (["model.dense_layers=one"], "config.model.dense_layers='one': give layer indices separated by commas"),
])
def test_bad_layer_choices_fail_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        models.build(mixed_config(*overrides).model)


def test_muon_takes_a_dense_layers_mlp_as_one_matrix_and_a_mixture_layers_experts_each_as_its_own():
    config = mixed_config("model.moe_every=2", "optim.optimizer=muon")
    boxed = models.param_shapes(config.model)
    optim.check_muon(boxed)
    params = nn.unbox(boxed)
    labels = optim.muon_labels(params)
    dense, mixture = labels["block_0"]["mlp"], labels["block_1"]["mlp"]
    assert dense["up"]["kernel"] == dense["down"]["kernel"] == mixture["up"] == mixture["down"] == "muon"
    assert dense["up"]["bias"] == mixture["up_bias"] == mixture["router"]["kernel"] == "adamw"
    key = jax.tree_util.DictKey
    dims = optim.matrix_axes((key("block_0"), key("mlp"), key("up"), key("kernel")), (D, F))
    assert (dims.reduction_axis, dims.output_axis) == (0, 1)
    dims = optim.matrix_axes((key("block_1"), key("mlp"), key("up")), (E, D, FE))  # E matrices [D, FE]
    assert (dims.reduction_axis, dims.output_axis) == (1, 2)


@pytest.mark.slow
def test_tiny_moe_with_every_other_layer_a_mixture_trains(tmp_path):
    config = shapes.resolved(config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny-moe"), [
        "model.moe_every=2", "data.seq_len=32", "data.batch_size=4", "data.eval_batches=1", "train.steps=3",
        "train.log_every=1", "train.eval_every=3", "train.checkpoint_every=3", "train.sample_tokens=0"]))
    last = loop.train(config, str(tmp_path), devices=jax.devices()[:1])
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    train = [r for r in records if "train/loss" in r]
    assert len(train) == 3 and all(math.isfinite(r["train/loss"]) for r in train)
    assert {"train/moe/load_balance", "train/moe/router_z", "train/moe/max_load"} <= set(train[0])
    assert last["train/moe/load_balance"] >= 1.0 and math.isfinite(last["train/moe/router_z"])
