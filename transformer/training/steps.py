"""The pure, jitted train and eval steps of any task, and the train state built in place.

A batch is a dict of arrays whose leading dimension is the batch (split over the mesh's
data x fsdp axes); the task decides what is in it and how it is scored.
"""

import flax.linen as nn
import jax
import optax
from flax.training import train_state

from transformer import parallel

TrainState = train_state.TrainState


def make_train_step(task, model: nn.Module):
    def train_step(state: TrainState, batch: dict, rng: jax.Array) -> tuple[TrainState, dict]:
        step_rng = jax.random.fold_in(rng, state.step)
        (loss, metrics), grads = jax.value_and_grad(
            lambda p: task.loss(model, p, batch, step_rng), has_aux=True)(state.params)
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            **metrics,
            "grad_norm": optax.tree.norm(grads),
            "param_norm": optax.tree.norm(params),
            "update_norm": optax.tree.norm(updates),
        }
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(task, model: nn.Module):
    def eval_step(params, batch: dict) -> dict:
        return task.eval_outputs(model, params, batch)

    return eval_step


def create_train_state(model: nn.Module, tx: optax.GradientTransformation, mesh, rules,
                       rng: jax.Array, init_inputs: tuple) -> tuple[TrainState, TrainState]:
    """The train state built in place on the mesh: shapes from eval_shape, then a jitted init.

    Returns (state, its shardings).
    """
    def init_boxed(rng):
        params = model.init(rng, *init_inputs)["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    abstract = jax.eval_shape(init_boxed, rng)
    shardings = parallel.logical_shardings(abstract, mesh, rules)
    init = jax.jit(lambda r: nn.unbox(init_boxed(r)), out_shardings=shardings)
    return init(rng), shardings
