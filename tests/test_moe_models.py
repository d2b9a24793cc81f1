"""Mixture-of-experts models: every family with experts in its Blocks (the router losses of each layer
reach the train step, scanned and rematerialised stacks too), their config checks, the objective and
the metrics of the train step (TensorBoard's histogram of the experts' load), Muon on the stacked
expert kernels, active parameters and FLOPs, the export's refusal, and data 2 x expert 4 through the
real train step against one device."""

import glob
import json
import os
import struct

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from tensorboardX.proto import event_pb2
from test_scale import family_config, train_losses

from transformer import config as config_lib
from transformer import models
from transformer.inference import engine, sampling
from transformer.interop import hf
from transformer.interop.hf_families import Unsupported
from transformer.layers import moe
from transformer.models import common, summary
from transformer.training import loop, optim, shapes, steps

E, K = 4, 2
EXPERTS = dict(num_experts=E, experts_per_token=K, moe_mlp_dim=16)
FAMILY_LAYERS = {"gpt": {}, "bert": {}, "vit": {}, "encdec": dict(num_decoder_layers=1)}
MOE = ["model.num_experts=8", "model.experts_per_token=2", "model.moe_mlp_dim=32"]


def small_model(family: str, **fields):
    cfg = models.family(family).model_config("tiny")
    cfg.update({**dict(num_layers=2, d_model=32, num_heads=4, mlp_dim=64), **FAMILY_LAYERS[family], **EXPERTS,
                **fields})
    return models.family(family).build(cfg)


def sown(model, params, *inputs) -> dict:
    """`moe.collect` of what a forward pass inside `common.sowing` keeps."""
    with common.sowing() as found:
        model.apply({"params": params}, *inputs)
    return moe.collect(found)


@pytest.mark.parametrize("family, fields", [
    ("gpt", {}), ("gpt", dict(scan_layers=True, remat="full")), ("bert", {}), ("vit", {}),
    ("encdec", dict(scan_layers=True)),
])
def test_every_family_sows_each_layers_router_losses(family, fields):
    """Shapes only: the load of every Block's experts [layers, E], encoder and decoder alike."""
    model = small_model(family, **fields)
    inputs = models.family(family).example_inputs(model)
    params = jax.eval_shape(lambda *x: nn.unbox(model.init(jax.random.key(0), *x)["params"]), *inputs)
    aux = jax.eval_shape(lambda p, *x: sown(model, p, *x), params, *inputs)
    layers = 2 + (family == "encdec")
    assert aux["load"].shape == (layers, E) and aux["load_balance"].shape == aux["router_z"].shape == ()
    dense = small_model(family, num_experts=0)
    assert jax.eval_shape(lambda p, *x: sown(dense, p, *x), jax.eval_shape(
        lambda *x: nn.unbox(dense.init(jax.random.key(0), *x)["params"]), *inputs), *inputs) == {}


@pytest.mark.parametrize("fields, message", [
    (dict(experts_per_token=5), "config.model.experts_per_token=5 must be in 1..num_experts=4"),
    (dict(num_experts=-1), "config.model.num_experts=-1 must be >= 0"),
    (dict(moe_dispatch="sorted"), "config.model.moe_dispatch='sorted': choose one of auto, dropless, capacity, dense"),
    (dict(shared_expert_gate=True), "config.model.shared_expert_gate=True gates a shared expert"),
    (dict(capacity_factor=0.0), "config.model.capacity_factor=0.0 must be positive"),
    (dict(moe_mlp_dim=-2), "config.model.moe_mlp_dim=-2 must be >= 0"),
])
def test_a_bad_mixture_fails_naming_the_key(fields, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        small_model("gpt", **fields)


class Regression:
    """A task whose loss is the mean square of GPT's logits."""

    def loss(self, model, params, batch, rng):
        loss = jnp.mean(model.apply({"params": params}, batch["tokens"]) ** 2)
        return loss, {"loss": loss}

    def loss_weights(self, batch):
        return {}


def test_the_objective_adds_the_weighted_router_losses_and_the_metrics_show_them_apart():
    model = small_model("gpt", moe_dispatch="capacity", capacity_factor=0.5)
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 50)
    params = nn.unbox(model.init(jax.random.key(0), tokens)["params"])
    loss, metrics, weighted = steps._task_loss(Regression(), model, params, {"tokens": tokens}, None,
                                               moe.Routing(load_balance_weight=0.5, router_z_weight=0.25))
    aux = sown(model, params, tokens)
    assert float(loss) == pytest.approx(float(jnp.mean(model.apply({"params": params}, tokens) ** 2)))
    assert float(weighted) == pytest.approx(0.5 * float(aux["load_balance"]) + 0.25 * float(aux["router_z"]))
    assert float(metrics["moe/router_z"]) == pytest.approx(float(aux["router_z"])) and float(aux["router_z"]) > 0
    np.testing.assert_allclose(metrics["moe/load"], aux["load"] * E)  # x E: 1 where balanced
    assert metrics["moe/load"].shape == (2, E) and 0 < float(metrics["moe/dropped"]) < 1


@pytest.mark.slow
def test_greedy_decoding_through_dropless_experts_equals_the_full_forward():
    model = small_model("gpt", positions="rotary", max_len=24, vocab_size=50, moe_dispatch="dropless")
    prompt = jax.random.randint(jax.random.key(3), (2, 4), 0, 50)
    params = nn.unbox(model.init(jax.random.key(0), prompt)["params"])
    new = np.array(engine.new_tokens(model, params, np.asarray(prompt).tolist(),
        sampling.Sampling(max_new_tokens=8)))
    logits = model.apply({"params": params}, jnp.concatenate([prompt, new], 1))  # [B, 12, V]
    np.testing.assert_array_equal(np.asarray(new), np.asarray(jnp.argmax(logits[:, 3:-1], -1)))


def histogram_tags(workdir) -> set[str]:
    """The tags of the histograms in a run's TensorBoard events (records: length, crc, event, crc)."""
    tags = set()
    for path in glob.glob(os.path.join(workdir, "tb", "*tfevents*")):
        data, at = open(path, "rb").read(), 0
        while at < len(data):
            length = struct.unpack("<Q", data[at:at + 8])[0]
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            tags |= {v.tag for v in event.summary.value if v.HasField("histo")}
            at += 16 + length
    return tags


def test_a_run_logs_the_router_losses_and_the_load_histogram(tmp_path, small_gpt_config, capsys):
    config = small_gpt_config(*MOE, "train.steps=2", "train.eval_every=2", "train.sample_tokens=0")
    last = loop.train(config, str(tmp_path), devices=jax.devices()[:1])
    said = capsys.readouterr().err  # the first lines say it will not export, and why
    assert said.index("export: no transformers class expresses this run, so convert --to_hf will refuse it: "
                      "config.model.num_experts=") < said.index("steps 0->2")
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert {"train/moe/load_balance", "train/moe/router_z", "train/moe/max_load"} <= set(records[0])
    assert last["train/moe/load_balance"] >= 1.0 and 1.0 <= last["train/moe/max_load"] <= 8 / 2
    assert "train/moe/load" not in records[0] and histogram_tags(tmp_path) == {"train/moe/load"}
    assert last["eval/moe/load_balance"] >= 1.0 and last["eval/moe/router_z"] > 0 and "eval/moe/load" not in last


def test_an_encoder_decoder_evaluates_its_router_losses_beside_what_it_decodes(tmp_path):
    """The eval step's greedy decoding (jitted on its own) keeps its router losses to itself."""
    config = family_config(tmp_path, "encdec", *MOE, "train.steps=1", "train.eval_every=1")
    last = loop.train(config, str(tmp_path / "run"), devices=jax.devices()[:1])
    assert "eval/bleu" in last and last["eval/moe/load_balance"] >= 1.0 and last["eval/moe/router_z"] > 0


@pytest.mark.slow
def test_data_2_x_expert_4_through_the_train_step_follows_one_device(tmp_path):
    one, _ = train_losses(family_config(tmp_path, "gpt", *MOE), tmp_path / "one", jax.devices()[:1])
    ours, state = train_losses(family_config(tmp_path, "gpt", *MOE, "mesh.data=2", "mesh.expert=4"),
                               tmp_path / "ours")
    np.testing.assert_allclose(ours, one, rtol=1e-5)
    up = state.params["block_0"]["mlp"]["up"]  # [E, D, F]: each device holds E / 4 experts
    assert up.sharding.spec[0] == "expert" and up.addressable_shards[0].data.shape == (2, 32, 32)


def test_the_mesh_must_split_the_experts_and_says_the_expert_axis_splits_the_batch(tmp_path):
    with pytest.raises(ValueError, match=r"^config.model.num_experts=6 does not split over the 4 devices"):
        loop.prepare(family_config(tmp_path, "gpt", "model.num_experts=6", "mesh.data=2", "mesh.expert=4"))
    with pytest.raises(ValueError, match=r"8-way batch split of the mesh \(data x fsdp x expert\)"):
        loop.prepare(family_config(tmp_path, "gpt", *MOE, "mesh.data=2", "mesh.expert=4", "data.batch_size=4"))


def test_muon_takes_each_expert_as_its_own_matrix_and_leaves_the_router_to_adamw():
    config = shapes.resolved(config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny-moe"), [
        "optim.optimizer=muon", "model.scan_layers=True", "model.shared_expert_dim=64", "model.shared_expert_gate=True",
        "model.activation=swiglu"]))
    boxed = models.param_shapes(config.model)
    optim.check_muon(boxed)
    mlp = nn.unbox(boxed)["blocks"]["block"]["mlp"]  # [layers, E, ...]
    labels = optim.muon_labels(mlp)
    assert {k: labels[k] for k in ("up", "gate", "down", "up_bias")} == dict(up="muon", gate="muon", down="muon",
                                                                             up_bias="adamw")
    assert labels["router"]["kernel"] == labels["shared_gate"]["kernel"] == "adamw"
    assert labels["shared"]["up"]["kernel"] == "muon"
    path = (jax.tree_util.DictKey("mlp"), jax.tree_util.DictKey("down"))
    dims = optim.matrix_axes(path, (4, 8, 384, 192))  # [layers, E, F, D]
    assert (dims.reduction_axis, dims.output_axis) == (2, 3)
    assert not optim.decay_mask(mlp)["up_bias"] and optim.decay_mask(mlp)["up"]


def test_tiny_moe_counts_all_its_experts_and_computes_with_two_of_eight():
    s = summary.summarize(shapes.resolved(config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny-moe"))))
    experts = 4 * (2 * 8 * 192 * 384 + 8 * 384 + 8 * 192)  # up, down and their biases in 4 layers
    assert s["total"] == 5_413_248 and s["active"] == s["total"] - experts * 6 // 8
    attention, router, embedding = 4 * 4 * 192 * 192, 4 * 192 * 8, 256 * 192
    assert s["matmul"] == attention + router + 4 * 2 * (2 * 192 * 384) + embedding  # 2 of the 8 up and down
    assert s["forward_flops"] == 2 * s["matmul"] + 4 * 4 * 192 * 128
    assert {"router", "expert up", "expert down", "expert up bias"} <= {r.kind for r in s["rows"]}
    assert "active parameters" in summary.format_summary(s)


def test_export_to_transformers_refuses_a_mixture():
    m = config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny-moe")).model.to_dict()
    with pytest.raises(Unsupported, match=r"^config.model.num_experts=8 has no equivalent in transformers' gpt2"):
        hf.exporter(m)
