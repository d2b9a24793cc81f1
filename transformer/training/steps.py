"""Pure train and eval steps for language modelling, and the sharded train state.

Glossary of shapes: B batch, L length, V vocab. A batch is int32 [B, L + 1]:
inputs are batch[:, :-1] and targets batch[:, 1:].
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from transformer import parallel

TrainState = train_state.TrainState


def lm_loss(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross entropy (float32) and the number of tokens. logits [B, L, V]."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return losses.sum(), jnp.array(losses.size, jnp.float32)


def make_train_step(model: nn.Module):
    def train_step(state: TrainState, batch: jax.Array, rng: jax.Array) -> tuple[TrainState, dict]:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        dropout_rng = jax.random.fold_in(rng, state.step)

        def loss_fn(params):
            logits = model.apply({"params": params}, inputs, deterministic=False,
                                 rngs={"dropout": dropout_rng})
            total, count = lm_loss(logits, targets)
            return total / count

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "param_norm": optax.tree.norm(params),
            "update_norm": optax.tree.norm(updates),
        }
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(model: nn.Module):
    def eval_step(params, batch: jax.Array) -> dict:
        logits = model.apply({"params": params}, batch[:, :-1])
        total, count = lm_loss(logits, batch[:, 1:])
        return {"loss_sum": total, "count": count}

    return eval_step


def create_train_state(model: nn.Module, tx: optax.GradientTransformation, mesh, rules,
                       rng: jax.Array, seq_len: int) -> tuple[TrainState, TrainState]:
    """The train state built in place on the mesh: shapes from eval_shape, then a jitted init.

    Returns (state, its shardings).
    """
    dummy = jnp.zeros((1, seq_len), jnp.int32)

    def init_boxed(rng):
        params = model.init(rng, dummy)["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    abstract = jax.eval_shape(init_boxed, rng)
    shardings = parallel.logical_shardings(abstract, mesh, rules)
    init = jax.jit(lambda r: nn.unbox(init_boxed(r)), out_shardings=shardings)
    return init(rng), shardings
