"""DeepSeek-V3's routing: the sigmoid router with its choice bias and grouped choice against transformers'
DeepseekV3TopkRouter, the bias's part (the choice, not the weights, nor the gradient), its keys' checks,
the optimizers leaving it alone, the export's refusal, and the train step's aux-loss-free balancing of each
layer's bias, scanned and unscanned stacks alike."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO
from test_moe import moe_mlp
from test_moe_models import Regression, small_model

from transformer import config as config_lib
from transformer.interop import hf
from transformer.interop.hf_families import Unsupported
from transformer.layers import moe
from transformer.training import checks, optim, steps

E, K, D = 8, 2, 16


@pytest.mark.parametrize("normalize", [True, False])
def test_sigmoid_grouped_routing_equals_transformers_deepseek_v3(normalize):
    torch = pytest.importorskip("torch")
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    config = DeepseekV3Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2,
                              norm_topk_prob=normalize, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    rng = np.random.default_rng(0)
    x, kernel, bias = rng.normal(size=(32, D)), rng.normal(size=(D, E)), 0.3 * rng.normal(size=E)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(kernel.T))
        router.e_score_correction_bias.copy_(torch.tensor(bias))
        _, their_weights, their_ids = router(torch.tensor(x, dtype=torch.float32))
    ids, weights, probs = moe.route(jnp.asarray(x @ kernel, jnp.float32), K, normalize, "sigmoid",
                                    jnp.asarray(bias, jnp.float32), groups=4, topk_groups=2, scale=2.5)
    order = np.argsort(their_ids.numpy(), axis=-1)  # theirs unsorted: compare by expert id
    np.testing.assert_array_equal(np.sort(ids, axis=-1), np.take_along_axis(their_ids.numpy(), order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), np.argsort(ids, -1), -1),
                               np.take_along_axis(their_weights.numpy(), order, -1), rtol=1e-5)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)


def test_grouped_choice_keeps_each_tokens_experts_within_its_best_groups():
    logits = jax.random.normal(jax.random.key(0), (4, 16, E))
    ids, _, _ = moe.route(logits, 3, True, groups=4, topk_groups=2)
    assert max(len(set(np.asarray(row) // 2)) for row in ids.reshape(-1, 3)) == 2
    ungrouped, _, _ = moe.route(logits, 3, True)
    assert max(len(set(np.asarray(row) // 2)) for row in ungrouped.reshape(-1, 3)) == 3


def test_the_bias_moves_the_choice_alone_and_takes_no_gradient():
    layer = moe_mlp(num_experts=E, experts_per_token=K, hidden=16, activation="swiglu", use_bias=False,
                    normalize_topk=True, router="sigmoid", routed_scale=2.0, param_dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(0), (2, 8, D))
    params = nn.unbox(layer.init(jax.random.key(1), x))["params"]
    assert params["router_bias"].dtype == jnp.float32 and not params["router_bias"].any()
    params["router_bias"] = params["router_bias"].at[5].set(10.0)  # expert 5 is every token's choice
    logits = x @ params["router"]["kernel"].astype(jnp.float32)
    ids, weights, _ = moe.route(logits, K, True, "sigmoid", params["router_bias"], scale=2.0)
    assert bool(jnp.all(jnp.any(ids == 5, -1)))
    np.testing.assert_allclose(weights.sum(-1), 2.0, rtol=1e-5)  # the unbiased scores, renormalised, x 2
    score = jax.nn.sigmoid(logits)
    np.testing.assert_allclose(weights, 2.0 * jnp.take_along_axis(score, ids, -1)
                               / jnp.take_along_axis(score, ids, -1).sum(-1, keepdims=True), rtol=1e-5)
    grads = jax.grad(lambda p: jnp.sum(jnp.sin(layer.apply({"params": p}, x))))(params)
    assert not grads["router_bias"].any() and grads["router"]["kernel"].any()
    softmax = moe_mlp(num_experts=E, experts_per_token=K, hidden=16)
    assert "router_bias" not in softmax.init(jax.random.key(1), x)["params"]


@pytest.mark.parametrize("fields, message", [
    (dict(router="tanh"), "config.model.router='tanh': choose one of softmax, sigmoid"),
    (dict(routed_scale=0.0), "config.model.routed_scale=0.0 must be positive"),
    (dict(router_groups=-1), "config.model.router_groups=-1 must be >= 0"),
    (dict(router_topk_groups=1), "config.model.router_topk_groups=1 needs router_groups > 0"),
    (dict(router_groups=3, router_topk_groups=1), "config.model.router_groups=3 must divide num_experts=4"),
    (dict(router_groups=2, router_topk_groups=3), "config.model.router_topk_groups=3 must be in 1..router_groups=2"),
    (dict(router_groups=4, router_topk_groups=1), "config.model.router_topk_groups=1 groups of 1 experts hold "
                                                  "fewer than experts_per_token=2"),
])
def test_a_bad_routing_key_fails_naming_it(fields, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        small_model("gpt", **fields)


@pytest.mark.parametrize("overrides, message", [
    (["train.router_bias_rate=-0.1"], r"config.train.router_bias_rate=-0.1 must be >= 0 \(0: off\)"),
    (["model.num_experts=4", "train.router_bias_rate=0.001"],
     "config.train.router_bias_rate=0.001 balances a sigmoid router's bias: set config.model.router=sigmoid"),
    (["train.router_bias_rate=0.001", "model.router=sigmoid"], "config.train.router_bias_rate=0.001 balances"),
])
def test_a_bias_rate_without_a_sigmoid_mixture_fails_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        checks.validate(config_lib.load(os.path.join(REPO, "configs", "gpt.py:tiny"), overrides))


@pytest.mark.parametrize("override, message", [
    ("model.router=sigmoid", "config.model.router='sigmoid' has no equivalent in transformers' Mixtral"),
    ("model.routed_scale=2.5", "config.model.routed_scale=2.5 has no equivalent"),
    ("model.router_groups=2", "config.model.router_groups=2 has no equivalent"),
])
def test_export_refuses_deepseek_routing(override, message):
    mixtral = ["model.positions=rotary", "model.activation=swiglu", "model.norm=rmsnorm", "model.use_bias=False"]
    m = config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny-moe"), mixtral).model.to_dict()
    hf.exporter(m).to_theirs(m)
    m = config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny-moe"), [*mixtral, override]).model.to_dict()
    with pytest.raises(Unsupported, match=f"^{message}"):
        hf.exporter(m).to_theirs(m)


@pytest.mark.parametrize("optimizer", list(optim.OPTIMIZERS))
def test_no_optimizer_moves_the_router_bias(optimizer):
    params = {"block_1": {"mlp": {"router_bias": jnp.zeros(4), "router": {"kernel": jnp.ones((8, 4))},
                                  "up": jnp.ones((4, 8, 8))}}}
    tx, _ = optim.make_optimizer(config_lib.optim_config(optimizer=optimizer, lr=0.1, warmup_steps=0), 10)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert not updates["block_1"]["mlp"]["router_bias"].any()
    assert updates["block_1"]["mlp"]["router"]["kernel"].any() and updates["block_1"]["mlp"]["up"].any()


# (model fields, the router params of each mixture layer: (path, its row in a scanned stack))
STACKS = {
    "unscanned-moe_every": (dict(num_layers=4, moe_every=2), [(("block_1", "mlp"), None), (("block_3", "mlp"), None)]),
    "scanned": (dict(num_layers=2, scan_layers=True), [(("blocks", "block", "mlp"), i) for i in (0, 1)]),
}


def _at(tree, path):
    for name in path:
        tree = tree[name]
    return tree


@pytest.mark.slow
@pytest.mark.parametrize("stack, accum", [("unscanned-moe_every", 1), ("scanned", 1), ("scanned", 2)])
@pytest.mark.parametrize("rate", [0.01, 0.0])
def test_the_train_step_balances_each_layers_bias_by_its_own_load(stack, accum, rate):
    """Layer j's expert `shunned[j]` gets no token (its bias set to -1, below any other's score); each bias moves by
    rate x sign(mean load - its load) in its own layer (the shunned expert's up); with rate 0, and by the
    optimizer, none moves."""
    fields, layers = STACKS[stack]
    model = small_model("gpt", router="sigmoid", vocab_size=50, **fields)
    tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, 50)
    params = nn.unbox(model.init(jax.random.key(0), tokens)["params"])
    shunned = [0, 3]
    for (path, row), expert in zip(layers, shunned):
        bias = _at(params, path)["router_bias"]
        _at(params, path)["router_bias"] = bias.at[(row, expert) if row is not None else expert].set(-1.0)
    tx, _ = optim.make_optimizer(config_lib.optim_config(lr=0.1, warmup_steps=0), 10)
    state = steps.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    step = jax.jit(steps.make_train_step(Regression(), model, accum_steps=accum, aux=moe.Routing(bias_rate=rate)))
    state, metrics = step(state, {"tokens": tokens}, jax.random.key(2))
    assert steps.CARRIED not in metrics
    load = np.asarray(metrics["moe/load"])  # [layers, E]: each layer's share x E (mean 1), in the layers' order
    for (path, row), expert, layer_load in zip(layers, shunned, load):
        bias = _at(state.params, path)["router_bias"]
        bias = np.asarray(bias[row] if row is not None else bias)
        assert layer_load[expert] == 0
        np.testing.assert_allclose(bias, rate * np.sign(1 - layer_load) - np.eye(4)[expert], rtol=1e-6)
    assert not np.array_equal(np.sign(1 - load[0]), np.sign(1 - load[1]))  # a layer's bias is not another's
