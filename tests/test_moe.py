"""The mixture-of-experts MLP: every dispatch against the dense reference (outputs and gradients),
transformers' sparse blocks (Mixtral, Qwen2-MoE, Qwen3-MoE) and their load-balancing loss, what a
capacity drops, the router losses and their collection over layers, expert parallelism on 8 fake
devices against one (outputs, gradients, SGD losses), the expert mesh axis, and the lowering for CUDA."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_gpu_attention import lower_for_cuda

from transformer import config as config_lib
from transformer import parallel, sharding
from transformer.layers import moe
from transformer.layers.moe_dispatch import queue_positions

E, K, D, F = 8, 2, 16, 16
FORMS = {  # activation, biases, renormalised top-k, shared expert width, its sigmoid gate
    "swiglu": dict(activation="swiglu", use_bias=False, normalize_topk=True),
    "gelu-bias-shared-gated": dict(activation="gelu", use_bias=True, shared_expert_dim=8, shared_expert_gate=True),
    "relu-bias-shared": dict(activation="relu", use_bias=True, shared_expert_dim=8),
}


def moe_mlp(num_experts: int, experts_per_token: int, hidden: int, **fields) -> moe.MoeMlp:
    """The layer of `num_experts` experts of width `hidden` with `fields`, the layer's or its `moe.Mixture`'s
    (unset: no renormalised top k, a capacity factor of 1)."""
    keys = {f.name for f in dataclasses.fields(moe.Mixture)}
    mixture = moe.Mixture(num_experts, experts_per_token=experts_per_token, moe_mlp_dim=hidden,
                          **{"normalize_topk": False, "capacity_factor": 1.0,
                             **{k: v for k, v in fields.items() if k in keys}})
    return moe.MoeMlp(mixture, **{k: v for k, v in fields.items() if k not in keys})


def layer(dispatch="dropless", **fields) -> moe.MoeMlp:
    return moe_mlp(E, K, F, moe_dispatch=dispatch,
                      **{**FORMS["swiglu"], **fields})


def inputs(batch=8, length=8, seed=0):
    return jax.random.normal(jax.random.key(seed), (batch, length, D))


def parameters(module, x, seed=1):
    """Initialised parameters, every one moved off its initial value (biases too)."""
    params = nn.unbox(module.init(jax.random.key(seed), x))["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(tree, [p + 0.1 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])


def value_and_grads(module, params, x):
    """(out, aux, d params, d x) of sum(sin(out)) + the router losses, jitted afresh: the active mesh is
    read at trace time."""
    def loss(params, x):
        out, state = module.apply({"params": params}, x, mutable=[moe.COLLECTION])
        aux = moe.collect(state[moe.COLLECTION])
        return jnp.sum(jnp.sin(out)) + aux["load_balance"] + 0.1 * aux["router_z"], (out, aux)
    (_, (out, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return out, aux, *grads


def assert_same(ours, reference, what, tol=1e-5):
    """Every leaf of `reference` (and the same leaf of `ours`) within tol x its largest magnitude."""
    if isinstance(reference, dict):
        ours = {key: ours[key] for key in reference}  # capacity's aux also says what it dropped
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(reference)[0], jax.tree.leaves(ours)):
        scale = float(jnp.max(jnp.abs(a))) or 1.0
        assert float(jnp.max(jnp.abs(a - b))) <= tol * scale, (what, jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("form", list(FORMS))
def test_each_dispatch_equals_the_dense_reference_forward_and_gradients(form):
    """Capacity with places for every slot (factor E / k) drops nothing."""
    x = inputs()
    fields = dict(FORMS[form], capacity_factor=E / K)
    params = parameters(layer("dense", **fields), x)
    dense = value_and_grads(layer("dense", **fields), params, x)
    assert jnp.max(jnp.abs(dense[2]["router"]["kernel"])) > 0  # the router learns through the weights
    for dispatch in ("dropless", "capacity"):
        ours = value_and_grads(layer(dispatch, **fields), params, x)
        for name, a, b in zip(("out", "aux", "d params", "d x"), dense, ours):
            assert_same(b, a, (form, dispatch, name))
    assert float(ours[1]["dropped"]) == 0.0


def test_each_expert_is_drawn_apart_and_kernels_carry_the_expert_axis():
    module = layer(**FORMS["gelu-bias-shared-gated"])
    boxed = module.init(jax.random.key(0), inputs())["params"]
    assert boxed["up"].names == (sharding.EXPERT, sharding.EMBED, sharding.MLP)
    assert boxed["down"].names == (sharding.EXPERT, sharding.MLP, sharding.EMBED)
    up = boxed["up"].value
    assert up.shape == (E, D, F) and not np.allclose(up[0], up[1])
    assert abs(float(jnp.std(up)) - 0.02) < 0.005
    assert set(boxed) == {"router", "up", "down", "up_bias", "down_bias", "shared", "shared_gate"}


HF_BLOCKS = {  # transformers class -> (its config, our fields)
    "Mixtral": (dict(num_local_experts=E, intermediate_size=F), dict(normalize_topk=True)),
    "Qwen3Moe": (dict(num_experts=E, moe_intermediate_size=F, norm_topk_prob=True), dict(normalize_topk=True)),
    "Qwen2Moe": (dict(num_experts=E, moe_intermediate_size=F, norm_topk_prob=False,
                      shared_expert_intermediate_size=24), dict(shared_expert_dim=24, shared_expert_gate=True)),
}


@pytest.mark.parametrize("cls", list(HF_BLOCKS))
def test_the_sparse_blocks_of_transformers_and_their_load_balancing_loss(cls):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kind = {"Mixtral": "mixtral", "Qwen3Moe": "qwen3_moe", "Qwen2Moe": "qwen2_moe"}[cls]
    modeling = getattr(transformers.models, kind)
    their_config, ours = HF_BLOCKS[cls]
    config = getattr(transformers, f"{cls}Config")(hidden_size=D, num_experts_per_tok=K, hidden_act="silu",
                                                   **their_config)
    torch.manual_seed(0)
    block = getattr(getattr(modeling, f"modeling_{kind}"), f"{cls}SparseMoeBlock")(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    x = np.random.default_rng(0).normal(size=(2, 5, D)).astype(np.float32)
    with torch.no_grad():
        theirs = block(torch.from_numpy(x)).numpy()
        logits = block.gate(torch.from_numpy(x))[0]
    t = lambda p: jnp.asarray(p.detach().numpy())
    gate_up = t(block.experts.gate_up_proj)  # [E, 2F, D]: gate rows, then up rows
    params = {"router": {"kernel": t(block.gate.weight).T}, "gate": gate_up[:, :F].transpose(0, 2, 1),
              "up": gate_up[:, F:].transpose(0, 2, 1), "down": t(block.experts.down_proj).transpose(0, 2, 1)}
    if cls == "Qwen2Moe":
        shared = block.shared_expert
        params["shared"] = {name: {"kernel": t(getattr(shared, f"{name}_proj").weight).T}
                            for name in ("up", "gate", "down")}
        params["shared_gate"] = {"kernel": t(block.shared_expert_gate.weight).T}
    module = moe_mlp(E, K, F, activation="swiglu", use_bias=False, **ours)
    out, state = module.apply({"params": params}, jnp.asarray(x), mutable=[moe.COLLECTION])
    np.testing.assert_allclose(out, theirs, atol=1e-5)
    their_loss = modeling.__dict__[f"modeling_{kind}"].load_balancing_loss_func((logits,), E, K)
    np.testing.assert_allclose(K * moe.collect(state[moe.COLLECTION])["load_balance"], float(their_loss),
                               rtol=1e-5)  # theirs counts each token's k slots as k tokens


def test_queue_positions_number_each_experts_slots_in_sequence_order():
    ids = jnp.array([[[0, 1], [1, 2], [0, 1]], [[2, 0], [2, 1], [1, 0]]])
    np.testing.assert_array_equal(queue_positions(ids, 3), [[[0, 0], [1, 0], [1, 2]], [[0, 0], [1, 0], [1, 1]]])


def test_a_small_capacity_drops_the_later_tokens_of_a_full_expert():
    """Every token chooses experts 0 and 1; with C = ceil(1.5 x 8 x 2 / 8) = 3 places each, the first 3
    tokens of each sequence go through them and the other 5 give 0."""
    x = inputs().at[..., 0].set(1.0)
    module = layer("capacity", capacity_factor=1.5)
    params = parameters(module, x)
    params["router"]["kernel"] = jnp.zeros((D, E)).at[0, :2].set(jnp.array([10.0, 9.0]))
    assert moe.places(1.5, 8, K, E) == 3
    out, state = module.apply({"params": params}, x, mutable=[moe.COLLECTION])
    dropless = layer("dropless").apply({"params": params}, x)
    np.testing.assert_allclose(out[:, :3], dropless[:, :3], atol=1e-6)
    assert float(jnp.max(jnp.abs(out[:, 3:]))) == 0.0 and float(jnp.max(jnp.abs(dropless[:, 3:]))) > 0
    aux = moe.collect(state[moe.COLLECTION])
    assert float(aux["dropped"]) == pytest.approx(5 / 8)
    np.testing.assert_allclose(aux["load"], [[0.5, 0.5] + [0.0] * (E - 2)])


def test_the_router_losses_against_their_formulas():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 6, E)), jnp.float32)
    ids, weights, probs = moe.route(logits, K, normalize=False)
    aux = moe.aux_losses(logits, probs, ids)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    chosen = np.argsort(-np.asarray(logits), axis=-1)[..., :K]
    np.testing.assert_array_equal(ids, chosen)
    np.testing.assert_allclose(weights, np.take_along_axis(p, chosen, -1), rtol=1e-6)
    f = np.bincount(chosen.ravel(), minlength=E) / chosen.size
    np.testing.assert_allclose(aux["load"], f)
    np.testing.assert_allclose(aux["load_balance"], E * np.sum(f * p.reshape(-1, E).mean(0)), rtol=1e-6)
    np.testing.assert_allclose(aux["router_z"], np.mean(np.log(np.exp(logits).sum(-1)) ** 2), rtol=1e-6)
    renormalised = moe.route(logits, K, normalize=True)[1]
    top = np.take_along_axis(np.asarray(logits), chosen, -1)
    np.testing.assert_allclose(renormalised, np.exp(top) / np.exp(top).sum(-1, keepdims=True), rtol=1e-6)
    # top-1 over E tokens: each to its own expert, surely -> 1; all to one expert, surely -> E
    balanced = jnp.zeros((1, E, E)).at[0, jnp.arange(E), jnp.arange(E)].set(30.0)
    collapsed = jnp.zeros((1, E, E)).at[..., 0].set(30.0)
    for logits, want in ((balanced, 1.0), (collapsed, float(E))):
        ids, _, probs = moe.route(logits, 1, normalize=False)
        assert float(moe.aux_losses(logits, probs, ids)["load_balance"]) == pytest.approx(want, rel=1e-4)


class Stack(nn.Module):
    """Two residual mixture-of-experts layers and a head: a layer-level model (scanned or not)."""

    dispatch: str = "dropless"
    scan: bool = False

    @nn.compact
    def __call__(self, x):
        fields = dict(num_experts=E, experts_per_token=K, hidden=F, activation="swiglu", use_bias=False,
                      normalize_topk=True, moe_dispatch=self.dispatch, capacity_factor=1.0)
        if self.scan:  # the collection stacked on the layer axis like the parameters
            layers = nn.scan(_Residual, variable_axes={"params": 0, moe.COLLECTION: 0}, split_rngs={"params": True},
                             length=2, metadata_params={nn.PARTITION_NAME: sharding.LAYERS})
            x, _ = layers(fields, name="layers")(x, None)
        else:
            for i in range(2):
                x = _Residual(fields, name=f"layer_{i}")(x, None)[0]
        return nn.Dense(D, kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.1),
                                                                     (sharding.EMBED, None)), name="head")(x)


class _Residual(nn.Module):
    fields: dict

    @nn.compact
    def __call__(self, x, _):
        norm = nn.RMSNorm(scale_init=nn.with_logical_partitioning(nn.initializers.ones, (sharding.NORM,)))
        return x + moe_mlp(**self.fields, name="mlp")(norm(x)), None


def test_collect_gathers_every_layer_scanned_or_not():
    x = inputs()
    for scan in (False, True):
        model = Stack(scan=scan)
        params = nn.unbox(model.init(jax.random.key(0), x))["params"]
        _, state = model.apply({"params": params}, x, mutable=[moe.COLLECTION])
        aux = moe.collect(state[moe.COLLECTION])
        assert aux["load"].shape == (2, E) and aux["load_balance"].shape == ()
        np.testing.assert_allclose(aux["load"].sum(-1), [1.0, 1.0], rtol=1e-6)
    assert moe.collect({}) == {}


MESHES = {"data=2,expert=4": dict(data=2, expert=4), "expert=8": dict(data=1, expert=8),
          "fsdp=2,expert=2,tensor=2": dict(data=1, fsdp=2, expert=2, tensor=2),
          "context=2,expert=4": dict(data=1, context=2, expert=4)}


def mesh_of(sizes: dict):
    mesh_config = config_lib.mesh_config()
    mesh_config.update(sizes)
    return parallel.make_mesh(mesh_config), sharding.rules_of(mesh_config)


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_expert_parallel_equals_one_device_forward_and_gradients(mesh_name, dispatch):
    """Capacity with a factor of 1 drops slots here: the same ones on every mesh."""
    x = inputs()
    module = layer(dispatch, capacity_factor=1.0, **FORMS["gelu-bias-shared-gated"])
    params = parameters(module, x)
    one = value_and_grads(module, params, x)
    mesh, rules = mesh_of(MESHES[mesh_name])
    with sharding.sharding_context(mesh, rules):
        ours = value_and_grads(module, params, x)
    for name, a, b in zip(("out", "aux", "d params", "d x"), one, ours):
        assert_same(b, a, (mesh_name, dispatch, name))
    if dispatch == "capacity":
        assert 0 < float(one[1]["dropped"]) < 0.5


def sgd_losses(dispatch: str, mesh_sizes: dict | None, steps: int = 3) -> tuple[list[float], dict]:
    """The losses of `steps` SGD steps of `Stack` (regression plus the router losses); on a mesh, the
    parameters placed by their logical axes."""
    x, target = inputs(seed=3), inputs(seed=4)
    model = Stack(dispatch)
    boxed = model.init(jax.random.key(0), x)["params"]
    params = nn.unbox(boxed)
    mesh, rules = mesh_of(mesh_sizes) if mesh_sizes else (None, None)
    if mesh is not None:
        params = jax.device_put(params, sharding.logical_shardings(boxed, mesh, rules))

    def step(params, x, target):
        def loss(params):
            out, state = model.apply({"params": params}, x, mutable=[moe.COLLECTION])
            aux = moe.collect(state[moe.COLLECTION])
            return jnp.mean((out - target) ** 2) + 0.01 * aux["load_balance"] + 1e-3 * aux["router_z"]
        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)

    losses, jitted = [], jax.jit(step)
    with sharding.sharding_context(mesh, rules):
        for _ in range(steps):
            value, params = jitted(params, x, target)
            losses.append(float(value))
    return losses, params


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_sgd_on_data_2_x_expert_4_follows_one_device(dispatch):
    one, _ = sgd_losses(dispatch, None)
    ours, params = sgd_losses(dispatch, dict(data=2, expert=4))
    np.testing.assert_allclose(ours, one, rtol=1e-5)
    assert one[-1] < one[0]
    up = params["layer_0"]["mlp"]["up"]  # [E, D, F]: each device holds E / 4 experts
    assert up.sharding.spec[0] == "expert" and up.addressable_shards[0].data.shape == (E // 4, D, F)


def test_the_expert_axis_comes_last_and_leaves_the_other_axes_as_they_were():
    mesh, _ = mesh_of(dict(data=2, fsdp=2, tensor=2))
    assert mesh.axis_names == ("data", "fsdp", "context", "tensor", "expert") and mesh.shape["expert"] == 1
    before = jax.make_mesh((2, 2, 1, 2), ("data", "fsdp", "context", "tensor"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 4)
    np.testing.assert_array_equal(np.vectorize(lambda d: d.id)(mesh.devices[..., 0]),
                                  np.vectorize(lambda d: d.id)(before.devices))
    mesh, rules = mesh_of(dict(data=2, expert=4))
    assert parallel.batch_divisor(mesh) == 8 and dict(rules)[sharding.EXPERT] == "expert"
    assert config_lib.mesh_config().expert == 1
    sharding.check_rules(config_lib.mesh_config())


def test_experts_that_do_not_split_over_the_expert_axis_fail_naming_the_key():
    """The dropless dispatch's shard_map over the expert axis (a run's mesh check says the same first)."""
    module = moe_mlp(num_experts=6, experts_per_token=2, hidden=F, moe_dispatch="dropless")
    x = inputs()
    params = nn.unbox(module.init(jax.random.key(0), x))["params"]
    mesh, rules = mesh_of(dict(data=2, expert=4))
    with sharding.sharding_context(mesh, rules), pytest.raises(ValueError, match="config.mesh.expert"):
        jax.jit(lambda p: module.apply({"params": p}, x))(params)
    with pytest.raises(ValueError, match="dispatch"):
        layer("sorted").init(jax.random.key(0), x)


def test_the_grouped_matmul_and_the_all_to_all_lower_for_cuda():
    """A bfloat16 step (forward and backward) on one device holds the grouped matmul; on data 2 x
    expert 4, the all-to-all as well."""
    module = layer(dtype=jnp.bfloat16)
    x = inputs().astype(jnp.bfloat16)
    params = nn.unbox(module.init(jax.random.key(0), x))["params"]

    def step(params, x):
        def loss(params):
            out, state = module.apply({"params": params}, x, mutable=[moe.COLLECTION])
            return jnp.mean(out.astype(jnp.float32) ** 2) + moe.collect(state[moe.COLLECTION])["load_balance"]
        return jax.value_and_grad(loss)(params)

    text = lower_for_cuda(jax.jit(step), params, x)
    assert text.count("ragged_dot") >= 3 and "all_to_all" not in text
    mesh, rules = mesh_of(dict(data=2, expert=4))
    with sharding.sharding_context(mesh, rules):
        text = lower_for_cuda(jax.jit(lambda p, x: step(p, x)), params, x, mesh=mesh)
    assert text.count("ragged_dot") >= 3 and text.count("stablehlo.all_to_all") >= 4


def test_auto_dispatches_by_the_fastest_exact_way_of_the_platform():
    assert moe.resolved_dispatch("auto") == moe.FASTEST_EXACT.get(jax.default_backend(), "dropless")
    assert moe.resolved_dispatch("auto") in ("dropless", "dense")  # exact: no slot dropped
    assert moe.resolved_dispatch("capacity") == "capacity"
    x = inputs()
    params = parameters(layer(), x)
    auto, _, *auto_grads = value_and_grads(layer("auto"), params, x)
    for dispatch in ("dropless", "dense"):
        out, _, *grads = value_and_grads(layer(dispatch), params, x)
        assert_same(auto, out, f"auto against {dispatch}")
        assert_same(auto_grads, grads, f"auto's gradients against {dispatch}", tol=1e-4)
