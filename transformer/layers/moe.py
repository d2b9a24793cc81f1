"""A mixture of experts in place of the position-wise MLP: a router picks k of E expert MLPs for each
token, whose outputs are summed with the router's weights; optionally a shared expert every token
goes through.

Glossary of shapes: B batch, L length, D model width, E experts, k experts per token, F expert mlp
width, T tokens (B L), C capacity (places per expert and sequence), G groups of experts.

The settings are one frozen record, `Mixture`: its fields are the config.model keys of their names, built
once from the config (a family's module holds it whole as `mixture`), carried whole into each `Block` that its
`layers` makes sparse and into that Block's `MoeMlp`, and checked in one place (`Mixture.checks`).

Router: logits = x W_router [B, L, E], in float32, no bias; scores s by `router`:
  softmax  s = softmax(logits); each token's k experts of largest s, weighted by their s, renormalised
           to sum to 1 with `normalize_topk`: Mixtral's form (its softmax over the top-k logits is the
           same weights) and Qwen2/3-MoE's `norm_topk_prob=True`; without it, Qwen2-MoE's (and
           Qwen3-MoE's `norm_topk_prob=False`).
  sigmoid  s = sigmoid(logits) (DeepSeek-V3's); the k experts of largest s + b are chosen, b the
           `router_bias` [E] (float32, zeros at init: its `e_score_correction_bias`), which the choice
           alone reads: the weights are the chosen s (renormalised with `normalize_topk`, its
           `norm_topk_prob`). The optimizer leaves b alone; the train step balances it (aux-loss-free
           balancing: `balance`). The load-balancing loss reads p = s / sum(s).
Either way the weights are then times `routed_scale` (DeepSeek-V3's `routed_scaling_factor`). With
`router_groups` G > 0 the choice is grouped (DeepSeek-V3's `n_group`, `topk_group`): the E experts form
G groups of E / G in order, a group scores the sum of its two best choice scores, and each token
chooses its k experts within its `router_topk_groups` best groups.

Experts: any form of `Mlp` (gelu | gelu_exact | relu, or gated swiglu | geglu; with or without
biases), stacked: up and gate [E, D, F], down [E, F, D] (logical axes expert, embed, mlp), biases
[E, F] and [E, D]. Each expert is initialised as an `Mlp` kernel would be.

Shared expert (`shared_expert_dim` > 0): an `Mlp` of that width every token goes through, added to the
routed output; DeepSeek's shared experts (one MLP of n_shared x F) as a plain sum, Qwen2-MoE's
`shared_expert` with `shared_expert_gate`: sigmoid(x w_gate) x shared(x), w_gate [D, 1]. Mixtral and
Qwen3-MoE have none.

Dispatch (`moe_dispatch`): `dropless` (sort by expert, grouped matmul), `capacity` (fixed shapes:
C = ceil(capacity_factor x L x k / E) places per expert in each sequence, later slots dropped) or
`dense` (every expert on every token: the reference); `auto` (the default) is the fastest exact one on the
default backend's platform (FASTEST_EXACT: `dense` on a CPU, where XLA's grouped matmul is slower than E
dense ones at the tiny sizes, experiments/moe_vs_dense/dispatch.md; `dropless` elsewhere). Under a mesh
with an `expert` axis the experts are split over it and the tokens travel to them by all-to-all.

Auxiliary outputs, sown into the `COLLECTION` ('moe') where the caller makes it mutable
(`model.apply(..., mutable=["moe"])`; elsewhere nothing is kept), computed over the whole batch:
  load_balance  E sum_e f_e P_e (Switch Transformer, Mixtral): f_e the fraction of the T k
                token-slots routed to e (sums to 1), P_e the mean of p_e over tokens; 1 when
                balanced, E when one expert takes all. (transformers' Mixtral and Qwen-MoE count f_e
                per token, summing to k: in one layer their value is k times this one; over several
                they pool the layers' f_e and P_e before the product, this averages the products.)
  router_z      mean over tokens of logsumexp(logits)^2 (ST-MoE's router z-loss).
  load          [E] f_e itself: a router collapsing onto few experts shows here first, and what
                `balance` moves a sigmoid router's bias by.
  dropped       (capacity only) the fraction of token-slots dropped.
`collect` gathers them over every layer of a model, `loads` each layer's load by its path. Padding
tokens count like the others. `Routing` is what a train step does with them: one record, one call before
the update and one after.
"""

import dataclasses
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer import sharding
from transformer.layers import moe_dispatch
from transformer.layers.mlp import ACTIVATIONS, GATES, Mlp
from transformer.layers.moe_dispatch import Experts
from transformer.sharding import BATCH, EMBED, EXPERT, LENGTH, MLP

Dtype = jnp.dtype

COLLECTION = "moe"
DISPATCHES = ("auto", "dropless", "capacity", "dense")
FASTEST_EXACT = {"cpu": "dense"}  # platform -> what `auto` dispatches by (dropless where not named)
AVERAGED = ("load_balance", "router_z", "dropped")  # scalars `collect` averages over layers
EXPERT_KERNELS = ("up", "gate", "down")  # the names of the stacked expert parameters: [E, ...] each
EXPERT_BIASES = ("up_bias", "gate_bias", "down_bias")
ROUTERS = ("softmax", "sigmoid")
ROUTER_BIAS = "router_bias"  # a sigmoid router's choice bias [E]: balanced by the train step, not the optimizer


@dataclasses.dataclass(frozen=True)
class Mixture:
    """A mixture of experts' settings, declared once: each field is the config.model key of its name (its meaning:
    transformer/config_keys.py). `num_experts` 0 is a dense mlp everywhere."""

    num_experts: int = 0           # > 0: a mixture of this many experts as mlp, in the Blocks `layers` picks
    moe_every: int = 1             # Block i (from 0) is a mixture where (i + 1) % moe_every == 0
    dense_first: int = 0           # the first this many Blocks keep a dense mlp
    dense_layers: str = ""         # Blocks that keep a dense mlp, by index: '0,2'
    experts_per_token: int = 2     # k: the experts the router sends each token to (its top k)
    moe_mlp_dim: int = 0           # each expert's hidden width F (0: the Block's mlp_dim)
    shared_expert_dim: int = 0     # > 0: the hidden width of a shared expert that every token also goes through
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(x w)
    normalize_topk: bool = True    # the k router weights renormalised to sum to 1
    router: str = "softmax"        # the router's scores: softmax | sigmoid (with a choice bias)
    routed_scale: float = 1.0      # the k router weights times this
    router_groups: int = 0         # > 0: the experts in this many groups, chosen within the best groups
    router_topk_groups: int = 0    # with router_groups: the groups each token chooses its experts in
    moe_dispatch: str = "auto"     # how tokens reach their experts: auto | dropless | capacity | dense
    capacity_factor: float = 1.25  # capacity: each expert takes ceil(this x L x k / E) token-slots of a sequence

    @classmethod
    def of(cls, model_config) -> "Mixture":
        """The record of config.model (a dict-like; a key it lacks takes its default)."""
        return cls(**{f.name: model_config[f.name] for f in dataclasses.fields(cls) if f.name in model_config})

    def layers(self, num_layers: int) -> list[bool]:
        """Whether each Block of a stack of `num_layers` holds the mixture: none without experts, else Block i
        (from 0) where i >= dense_first and (i + 1) % moe_every == 0 (Llama 4's and Qwen3-MoE's step,
        DeepSeek-V3's first dense layers) and i is not among `dense_layers` (Qwen3-MoE's mlp_only_layers)."""
        if not self.num_experts:
            return [False] * num_layers
        return mixture_layers(num_layers, self.moe_every, self.dense_first, self.dense_layers)

    def width(self, mlp_dim: int) -> int:
        """F: each expert's hidden width (`moe_mlp_dim`, or the Block's dense `mlp_dim` where that is 0)."""
        return self.moe_mlp_dim or mlp_dim

    def checks(self, num_layers: int | None = None) -> list[tuple[bool, str]]:
        """(ok, message) of every rule, naming config.model keys: with experts, a known router and dispatch, each
        token routed to 1..num_experts of them (within groups that divide the experts and hold k of them),
        widths not negative, a shared expert where it gates one, a positive capacity and routed scale, and
        (given `num_layers`: a stack's, not one layer's) at least one of the stack's Blocks a mixture
        (`dense_layers` naming Blocks that exist)."""
        e, k, every, first = self.num_experts, self.experts_per_token, self.moe_every, self.dense_first
        g, t, dense = self.router_groups, self.router_topk_groups, self.dense_layers
        stack = [] if num_layers is None else [
            *[(0 <= i < num_layers, f"config.model.dense_layers={dense!r}: layer {i} is not among the "
               f"num_layers={num_layers} Blocks (0..{num_layers - 1})") for i in layer_indices(dense)],
            (not e or every < 1 or any(self.layers(num_layers)),
             f"config.model.dense_first={first}, moe_every={every} and dense_layers={dense!r} leave none of "
             f"the num_layers={num_layers} Blocks a mixture of experts"),
        ]
        return [
            (e >= 0, f"config.model.num_experts={e} must be >= 0 (0: a dense mlp)"),
            (every >= 1, f"config.model.moe_every={every} must be >= 1 (1: every Block)"),
            (first >= 0, f"config.model.dense_first={first} must be >= 0 (0: none)"),
            *stack,
            (self.router in ROUTERS, f"config.model.router={self.router!r}: choose one of {', '.join(ROUTERS)}"),
            (self.moe_dispatch in DISPATCHES,
             f"config.model.moe_dispatch={self.moe_dispatch!r}: choose one of {', '.join(DISPATCHES)}"),
            (not e or 1 <= k <= e, f"config.model.experts_per_token={k} must be in 1..num_experts={e}"),
            *[(getattr(self, key) >= 0, f"config.model.{key}={getattr(self, key)} must be >= 0")
              for key in ("moe_mlp_dim", "shared_expert_dim")],
            (not e or not self.shared_expert_gate or self.shared_expert_dim > 0,
             "config.model.shared_expert_gate=True gates a shared expert: set config.model.shared_expert_dim > 0"),
            (not e or self.capacity_factor > 0,
             f"config.model.capacity_factor={self.capacity_factor} must be positive"),
            (not e or self.routed_scale > 0, f"config.model.routed_scale={self.routed_scale} must be positive"),
            (not e or g >= 0, f"config.model.router_groups={g} must be >= 0 (0: no groups)"),
            (not e or g or not t, f"config.model.router_topk_groups={t} needs router_groups > 0 (0: no groups)"),
            (not e or not g or e % g == 0, f"config.model.router_groups={g} must divide num_experts={e}"),
            (not e or not g or 1 <= t <= g, f"config.model.router_topk_groups={t} must be in 1..router_groups={g}"),
            (not e or not g or t * (e // g) >= k, f"config.model.router_topk_groups={t} groups of {e // max(g, 1)} "
                                                  f"experts hold fewer than experts_per_token={k}"),
        ]

    def check(self, num_layers: int | None = None) -> None:
        """Raises ValueError with the message of the first rule of `checks` that fails."""
        for ok, message in self.checks(num_layers):
            if not ok:
                raise ValueError(message)


def mixture_layers(num_layers: int, moe_every: int = 1, dense_first: int = 0, dense_layers: str = "") -> list[bool]:
    """Whether each layer of a stack holds the mixture of experts: layer i (from 0) does where
    i >= dense_first and (i + 1) % moe_every == 0 and i is not among `dense_layers` (comma-separated indices)."""
    dense = set(layer_indices(dense_layers))
    return [i >= dense_first and (i + 1) % moe_every == 0 and i not in dense for i in range(num_layers)]


def layer_indices(text: str) -> list[int]:
    """'0,2' (or '(0,2)', '[0, 2]') -> [0, 2] (config.model.dense_layers); a ValueError naming the key where
    an entry is no integer."""
    try:
        return [int(part) for part in text.strip("()[] ").replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(f"config.model.dense_layers={text!r}: give layer indices separated by commas, "
                         "e.g. 0,2") from None


def route(logits: jax.Array, k: int, normalize: bool, router: str = "softmax", bias: jax.Array | None = None,
          groups: int = 0, topk_groups: int = 0, scale: float = 1.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [B, L, E] -> (ids [B, L, k] of the chosen experts, their weights [B, L, k], the probabilities
    [B, L, E] that the load-balancing loss reads), by the module docstring's Router; `bias` [E] (sigmoid
    only) shifts the choice alone."""
    logits = logits.astype(jnp.float32)
    if router == "softmax":
        scores = probs = jax.nn.softmax(logits, axis=-1)
        choice = logits
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
        choice = scores if bias is None else scores + bias
    if groups:
        choice = _within_groups(choice, groups, topk_groups)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return ids, weights * scale, probs


def _within_groups(choice: jax.Array, groups: int, topk_groups: int) -> jax.Array:
    """choice [B, L, E] with every expert outside each token's `topk_groups` best of `groups` groups at -inf; a
    group scores the sum of its two best."""
    *lead, experts = choice.shape
    grouped = choice.reshape(*lead, groups, experts // groups)  # [B, L, G, E / G]
    score = jnp.sum(jax.lax.top_k(grouped, min(2, experts // groups))[0], axis=-1)  # [B, L, G]
    _, kept = jax.lax.top_k(score, topk_groups)  # [B, L, topk_groups]
    keep = jnp.any(kept[..., None] == jnp.arange(groups), axis=-2)  # [B, L, G]
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)


def aux_losses(logits: jax.Array, probs: jax.Array, ids: jax.Array) -> dict[str, jax.Array]:
    """logits, probs [B, L, E], ids [B, L, k] -> load_balance and router_z (scalars), load [E]."""
    experts = logits.shape[-1]
    load = jnp.bincount(ids.reshape(-1), length=experts) / ids.size  # f_e over the T k slots
    balance = experts * jnp.sum(load * jnp.mean(probs.reshape(-1, experts), axis=0))
    z = jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2)
    return {"load_balance": balance, "router_z": z, "load": load}


def places(capacity_factor: float, length: int, k: int, experts: int) -> int:
    """C: each expert's places in a sequence of `length` tokens (at least 1)."""
    return max(1, math.ceil(capacity_factor * length * k / experts))


def collect(state) -> dict[str, jax.Array]:
    """The `COLLECTION` of an `apply(..., mutable=["moe"])` (the tree under its key) over every
    mixture-of-experts layer, scanned stacks included: load_balance, router_z (and dropped) averaged
    over the layers; load [layers that sowed, E]. {} where no layer sowed."""
    found: dict[str, list] = {}
    for path, value in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = next(p.key for p in reversed(path) if isinstance(p, jax.tree_util.DictKey))
        found.setdefault(name, []).append(value)
    out = {name: jnp.mean(jnp.concatenate([jnp.ravel(v) for v in found[name]])) for name in AVERAGED
           if name in found}
    if "load" in found:
        out["load"] = jnp.concatenate([v.reshape(-1, v.shape[-1]) for v in found["load"]])
    return out


def loads(state) -> dict[str, jax.Array]:
    """Each mixture layer's load f_e in a `COLLECTION` (as `collect` takes it) by its module's path
    ('decoder_0/mlp'): [E], or [N, E] for a scanned stack; the mean where several applies sowed it."""
    found: dict[str, list] = {}
    for path, value in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
        if names[-1] == "load":
            found.setdefault("/".join(names[:-1]), []).append(value)
    return {path: jnp.mean(jnp.stack(values), axis=0) for path, values in found.items()}


def balance(params, layer_loads: dict[str, jax.Array], rate: float):
    """Aux-loss-free balancing (DeepSeek-V3): `params` with each `ROUTER_BIAS` b [E] (or [N, E]) moved by
    rate x sign(mean load - the expert's load), its layer's load from `loads` (keyed by its module's path)."""
    def step(path, b):
        names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
        if names[-1] != ROUTER_BIAS:
            return b
        load = layer_loads["/".join(names[:-1])]
        return b + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load).astype(b.dtype)
    return jax.tree_util.tree_map_with_path(step, params)


@dataclasses.dataclass(frozen=True)
class Routing:
    """How training treats a mixture of experts' routers: the weights of its router losses in the objective
    (config.train.load_balance_weight, router_z_weight) and the rate that balances a sigmoid router's bias
    after each update (config.train.router_bias_rate). A train step calls `losses` on what its forward
    pass sowed and `update` on the new params; for a model without experts both leave everything as it is."""

    load_balance_weight: float = 0.0
    router_z_weight: float = 0.0
    bias_rate: float = 0.0

    def losses(self, sown) -> tuple[dict[str, jax.Array], jax.Array | int, dict]:
        """(moe/* metrics, the weighted sum of the router losses (0 without experts), each layer's load for
        `update`) of the values one forward pass sowed (`collect`)."""
        aux = collect(sown)
        if "load" not in aux:
            return {f"moe/{name}": value for name, value in aux.items()}, 0, {}
        aux["load"] = aux["load"] * aux["load"].shape[-1]  # [layers, E]: 1 where balanced
        weights = {"load_balance": self.load_balance_weight, "router_z": self.router_z_weight}
        weighted = sum(weight * aux[name] for name, weight in weights.items() if name in aux)
        return {f"moe/{name}": value for name, value in aux.items()}, weighted, loads(sown)

    def update(self, params, metrics: dict, layer_loads: dict):
        """(params, metrics) after the optimizer's update: each router bias balanced by its layer's load
        (`balance`, where `bias_rate` > 0), moe/max_load (the busiest expert's share x E) added."""
        if "moe/load" in metrics:
            metrics = {**metrics, "moe/max_load": jnp.max(metrics["moe/load"])}
        if self.bias_rate and layer_loads:
            params = balance(params, layer_loads, self.bias_rate)
        return params, metrics

    def eval_metrics(self, sown) -> dict[str, jax.Array]:
        """The router losses of an eval batch's forward passes (moe/load_balance, moe/router_z, and with
        capacity moe/dropped), which the eval loop averages."""
        aux = collect(sown)
        return {f"moe/{name}": aux[name] for name in AVERAGED if name in aux}

    @classmethod
    def of(cls, config) -> "Routing":
        """The run's routing: config.train's weights and rate where config.model has experts, else none; a
        ValueError naming the key where the rate is negative or has no sigmoid router to balance."""
        t, mixture = config.train, Mixture.of(config.model)
        if t.router_bias_rate < 0:
            raise ValueError(f"config.train.router_bias_rate={t.router_bias_rate} must be >= 0 (0: off)")
        if t.router_bias_rate and (not mixture.num_experts or mixture.router != "sigmoid"):
            raise ValueError(f"config.train.router_bias_rate={t.router_bias_rate} balances a sigmoid router's bias: "
                             "set config.model.router=sigmoid (with num_experts > 0), or the rate to 0")
        if not mixture.num_experts:
            return cls()
        return cls(t.load_balance_weight, t.router_z_weight, t.router_bias_rate)


NO_ROUTING = Routing()  # a train step's default: a model without experts, or weights of 0


def _stacked(init: Callable) -> Callable:
    """An initializer of [E, ...] drawing each expert's [...] as `init` would draw one kernel."""
    def stacked(key, shape, dtype=jnp.float32):
        return jax.vmap(lambda one: init(one, shape[1:], dtype))(jax.random.split(key, shape[0]))
    return stacked


def resolved_dispatch(dispatch: str) -> str:
    """`dispatch`, or for 'auto' the fastest exact one on the default platform (FASTEST_EXACT)."""
    return FASTEST_EXACT.get(jax.default_backend(), "dropless") if dispatch == "auto" else dispatch


class MoeMlp(nn.Module):
    """x [B, L, D] -> [B, L, D] through k of the `mixture`'s experts per token, each an mlp of width
    `mixture.width(mlp_dim)` (the module docstring has the forms); the auxiliary outputs are sown into 'moe'."""

    mixture: Mixture
    mlp_dim: int = 0  # the Block's dense width: each expert's where mixture.moe_mlp_dim is 0
    activation: str = "gelu"
    use_bias: bool = True
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    kernel_init: Callable = nn.initializers.normal(0.02)
    out_kernel_init: Callable | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, L, D] -> [B, L, D]."""
        m = self.mixture
        m.check()
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown mlp activation {self.activation!r}; choose one of {sorted(ACTIVATIONS)}")
        length, width = x.shape[1], x.shape[2]
        router = nn.Dense(m.num_experts, use_bias=False, dtype=jnp.float32, param_dtype=self.param_dtype,
                          kernel_init=nn.with_logical_partitioning(self.kernel_init, (EMBED, None)), name="router")
        logits = sharding.constrain(router(x.astype(jnp.float32)), (BATCH, LENGTH, None))  # [B, L, E]
        bias = self.param(ROUTER_BIAS, nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                          (m.num_experts,), jnp.float32) if m.router == "sigmoid" else None
        ids, weights, probs = route(logits, m.experts_per_token, m.normalize_topk, m.router, bias,
                                    m.router_groups, m.router_topk_groups, m.routed_scale)
        for name, value in aux_losses(logits, probs, ids).items():
            self.sow(COLLECTION, name, value)
        experts = self._experts(width)
        fields = dict(activation=self.activation, dtype=self.dtype)
        dispatch = resolved_dispatch(m.moe_dispatch)
        if dispatch == "dense":
            y = moe_dispatch.dense(x, ids, weights, experts, **fields)
        elif dispatch == "dropless":
            y = moe_dispatch.on_devices(moe_dispatch.dropless, x, (ids, weights), experts, **fields)
        else:
            c = places(m.capacity_factor, length, m.experts_per_token, m.num_experts)
            positions = moe_dispatch.queue_positions(ids, m.num_experts)
            self.sow(COLLECTION, "dropped", jnp.mean(positions >= c))
            y = moe_dispatch.on_devices(moe_dispatch.capacity, x, (ids, weights, positions), experts, places=c,
                                        **fields)
        y = sharding.constrain(y, (BATCH, LENGTH, EMBED))
        if m.shared_expert_dim:
            y = y + self._shared(x)
        return y

    def _experts(self, width: int) -> Experts:
        e, f = self.mixture.num_experts, self.mixture.width(self.mlp_dim)
        kernel = lambda name, shape, axes, init: self.param(
            name, nn.with_logical_partitioning(_stacked(init), axes), shape, self.param_dtype)
        bias = lambda name, shape, axes: self.param(
            name, nn.with_logical_partitioning(nn.initializers.zeros, axes), shape, self.param_dtype) \
            if self.use_bias else None
        gated = self.activation in GATES
        return Experts(
            up=kernel("up", (e, width, f), (EXPERT, EMBED, MLP), self.kernel_init),
            gate=kernel("gate", (e, width, f), (EXPERT, EMBED, MLP), self.kernel_init) if gated else None,
            down=kernel("down", (e, f, width), (EXPERT, MLP, EMBED), self.out_kernel_init or self.kernel_init),
            up_bias=bias("up_bias", (e, f), (EXPERT, MLP)),
            gate_bias=bias("gate_bias", (e, f), (EXPERT, MLP)) if gated else None,
            down_bias=bias("down_bias", (e, width), (EXPERT, EMBED)),
        )

    def _shared(self, x: jax.Array) -> jax.Array:
        """The shared expert's output [B, L, D], gated by sigmoid(x w_gate) with `shared_expert_gate`."""
        y = Mlp(self.mixture.shared_expert_dim, self.activation, use_bias=self.use_bias, dtype=self.dtype,
                param_dtype=self.param_dtype, kernel_init=self.kernel_init, out_kernel_init=self.out_kernel_init,
                name="shared")(x)
        if not self.mixture.shared_expert_gate:
            return y
        gate = nn.Dense(1, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                        kernel_init=nn.with_logical_partitioning(self.kernel_init, (EMBED, None)),
                        name="shared_gate")(x)  # [B, L, 1]
        return jax.nn.sigmoid(gate) * y
