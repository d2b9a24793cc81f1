"""The pure, jitted train and eval steps of any task, and the train state built in place.

A batch is a dict of arrays whose leading dimension is the batch (split over the mesh's
data x fsdp axes); the task decides what is in it and how it is scored. The steps are
traced in `sharding.sharding_context`, so the layers' activation constraints
(`sharding.constrain`) take effect.

Gradient accumulation (`accum_steps` k > 1) splits the batch into k microbatches of
B / k rows, each taking every k-th row so that it stays spread over the same devices, and
scans over them: only one microbatch's activations are alive at a time. The loss is a sum
of terms, each a mean over some items (`task.loss_weights`: masked tokens, rows, ...); a
microbatch's term is weighted by its share of the whole batch's items, so the summed
gradients and metrics are exactly those of the whole batch (a term the task does not name
is weighted 1 / k, exact when every microbatch has as many of its items). The metrics carry each
term's items (`metrics.ITEMS`), by which the log weighs the steps it averages.

A model may sow auxiliary losses in its forward pass (`common.sowing`); `aux` (`common.auxiliary`,
built from the run's config) turns what one pass sowed into metrics and a weighted term of the
objective, and changes the params after the update where its rule says so. The eval step gives the
auxiliary metrics of its forward passes too (`aux.eval_metrics`).
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util
from flax.training import train_state

from transformer import sharding
from transformer.models import common
from transformer.training import metrics as metrics_lib

TrainState = train_state.TrainState
AUX = "aux"  # the eval step's auxiliary metrics, beside the task's outputs
CARRIED = "aux/carried"  # what `aux.losses` hands to `aux.update` through the metrics, never logged


def make_train_step(task, model: nn.Module, mesh=None, rules=(), accum_steps: int = 1, aux=common.NO_AUXILIARY):
    """The jitted-to-be step; `aux` weighs the model's auxiliary losses in the objective and updates after
    the optimizer (see the module docstring)."""

    def train_step(state: TrainState, batch: dict, rng: jax.Array) -> tuple[TrainState, dict]:
        step_rng = bits_key(jax.random.fold_in(rng, state.step))
        with sharding.sharding_context(mesh, rules):
            metrics, grads = _grads(task, model, state.params, batch, step_rng, accum_steps, aux)
        carried = metrics.pop(CARRIED, {})
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        params, metrics = aux.update(optax.apply_updates(state.params, updates), metrics, carried)
        items = {metrics_lib.ITEMS + term: count for term, count in _as_float(task.loss_weights(batch)).items()}
        metrics = {**metrics, **items, "grad_norm": optax.tree.norm(grads), **_norms(params, updates)}
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def _norms(params, updates) -> dict:
    """The new parameters' and the update's norms, read after the update is written.

    The barrier keeps their reductions out of the update's fusion. XLA:GPU fuses the optimizer's
    elementwise pass with both reductions, and a fusion with two reductions may not write its outputs
    over its inputs: the H100's ViT-S step then copied every parameter, mu and nu (474 copies) after
    the update. Apart, the update is one in-place pass over the state, and the norms read the new
    parameters and the update once more.
    """
    params, updates = jax.lax.optimization_barrier((params, updates))
    return {"param_norm": optax.tree.norm(params), "update_norm": optax.tree.norm(updates)}


def bits_key(key: jax.Array) -> jax.Array:
    """The step's key as an `rbg` key (its threefry words twice): dropout and drop path then draw their
    bits with XLA's RngBitGenerator (Philox on a GPU) rather than threefry's ~20 integer ops per word
    over whole activations; derived from the step alone, so resumes stay exact (the data's own keys,
    which are vmapped, stay threefry: `device_views`)."""
    words = jax.random.key_data(key)
    return jax.random.wrap_key_data(jnp.concatenate([words, words], axis=-1), impl="rbg")


def _task_loss(task, model, params, batch: dict, rng: jax.Array, aux) -> tuple:
    """(the task's loss, its metrics with the auxiliary ones (and `CARRIED`), the weighted auxiliary losses:
    0 where the model sows none)."""
    with common.sowing() as sown:
        loss, metrics = task.loss(model, params, batch, rng)
    aux_metrics, weighted, carried = aux.losses(sown)
    return loss, {**metrics, **aux_metrics, **({CARRIED: carried} if carried else {})}, weighted


def _grads(task, model, params, batch: dict, rng: jax.Array, accum_steps: int, aux) -> tuple[dict, object]:
    """(metrics, gradients) of the task's loss (plus the weighted auxiliary losses) on `batch`, over
    `accum_steps` microbatches."""
    if accum_steps == 1:
        def objective(p):
            loss, metrics, weighted = _task_loss(task, model, p, batch, rng, aux)
            return loss + weighted, metrics
        (_, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return metrics, grads
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:])
                         .swapaxes(0, 1), batch)  # [k, B / k, ...]: microbatch i = rows i, i + k, ...
    totals = _as_float(task.loss_weights(batch))

    def micro_loss(p, mb, r):
        """The microbatch's share of the whole batch's loss, and its metrics weighted alike (a part
        of the loss that no term names counts 1 / k, as do the auxiliary losses: means over every token)."""
        loss, metrics, weighted = _task_loss(task, model, p, mb, r, aux)
        share = jax.tree.map(lambda w, total: w / jnp.maximum(total, 1.0), _as_float(task.loss_weights(mb)), totals)
        unnamed = loss - sum(metrics[term] for term in share)
        loss = unnamed / accum_steps + sum(share[term] * metrics[term] for term in share)
        return loss + weighted / accum_steps, {**jax.tree.map(lambda v: v / accum_steps, metrics),
                                               **{term: share[term] * metrics[term] for term in share}, "loss": loss}

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def accumulate(sums, i):
        mb = jax.tree.map(lambda x: _batch_constraint(x[i]), micro)
        (_, metrics), grads = grad_fn(params, mb, jax.random.fold_in(rng, i))
        return jax.tree.map(jnp.add, sums, (metrics, grads)), None

    (_, metric_shapes), _ = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro), rng)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), (metric_shapes, params))
    (metrics, grads), _ = jax.lax.scan(accumulate, zeros, jnp.arange(accum_steps))
    return metrics, grads


def _as_float(weights: dict) -> dict:
    return {k: jnp.asarray(w, jnp.float32) for k, w in weights.items()}


def _batch_constraint(x: jax.Array) -> jax.Array:
    return sharding.constrain(x, (sharding.BATCH,) + (None,) * (x.ndim - 1))


def make_eval_step(task, model: nn.Module, mesh=None, rules=(), aux=common.NO_AUXILIARY):
    """The eval step: the task's eval outputs, and the auxiliary metrics of the batch's forward passes
    (`aux.eval_metrics`, under `AUX`; `loop.evaluate` averages them into eval/...)."""
    def eval_step(params, batch: dict) -> dict:
        with sharding.sharding_context(mesh, rules), common.sowing() as sown:
            outputs = task.eval_outputs(model, params, batch)
        return {**outputs, AUX: aux.eval_metrics(sown)}

    return eval_step


def create_train_state(model: nn.Module, tx: optax.GradientTransformation, mesh, rules,
                       rng: jax.Array, init_inputs: tuple, shardings=None) -> tuple[TrainState, TrainState]:
    """The train state built in place on the mesh: shapes from eval_shape (or the state's `shardings`,
    where `abstract_train_state` gave them already), then a jitted init.

    Returns (state, its shardings).
    """
    if shardings is None:
        _, shardings = abstract_train_state(model, tx, mesh, rules, init_inputs)
    init = jax.jit(lambda r: nn.unbox(_init_boxed(model, tx, init_inputs, r)), out_shardings=shardings)
    return init(rng), shardings


def abstract_train_state(model: nn.Module, tx: optax.GradientTransformation, mesh, rules,
                         init_inputs: tuple) -> tuple[TrainState, TrainState]:
    """(shapes, shardings) of the train state, nothing allocated. A parameter that does not
    split evenly over the mesh axes its rules name fails here, naming it."""
    boxed = jax.eval_shape(lambda r: _init_boxed(model, tx, init_inputs, r), jax.random.key(0))
    state, shardings = nn.unbox(boxed), sharding.logical_shardings(boxed, mesh, rules)
    check_divisible(state.params, shardings.params, mesh, nn.get_partition_spec(boxed.params))
    return state, shardings


def _init_boxed(model, tx, init_inputs, rng) -> TrainState:
    params = model.init(rng, *init_inputs)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def check_divisible(params, shardings, mesh, logical=None) -> None:
    """Raises ValueError naming the first parameter whose dimension does not divide by its mesh split.

    `logical` (the params' logical PartitionSpecs) lets the message suggest padding the vocabulary.
    """
    flat = traverse_util.flatten_dict(params, sep="/")
    placements = traverse_util.flatten_dict(shardings, sep="/")
    names = traverse_util.flatten_dict(logical, sep="/") if logical is not None else {}
    for name, value in flat.items():
        for dim, (size, axes) in enumerate(zip(value.shape, placements[name].spec)):
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            ways = math.prod(mesh.shape[a] for a in axes)
            if size % ways:
                fix = "change the mesh sizes or config.mesh.rules"
                if name in names and names[name][dim] == sharding.VOCAB:
                    multiple = math.lcm(128, ways)
                    fix = (f"pad config.model.vocab_size to {-(-size // multiple) * multiple} (unused ids), "
                           f"or {fix}")
                raise ValueError(f"config.mesh: parameter {name} {tuple(value.shape)} has dimension {dim} of "
                                 f"size {size}, which does not split {ways} ways over {axes}; {fix}")
