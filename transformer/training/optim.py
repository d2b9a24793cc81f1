"""The optimizer from config.optim: its update rule, its learning-rate schedule, global-norm clipping.

Optimizers (`config.optim.optimizer`), each with decoupled weight decay (`lr x weight_decay x w`)
that spares biases and norm scales (`decay_mask`), none moving a sigmoid router's bias (`FROZEN`: the
train step balances it):
  adamw      AdamW (b1, b2, eps).
  muon       Muon (optax's Newton-Schulz orthogonalised momentum) for the hidden weight matrices,
             AdamW for what Muon does not take (embeddings, the output head, the patch projection,
             norms, biases; a mixture of experts' router and shared-expert gate), as its authors
             prescribe. `matrix_axes` says which parameters are its matrices and how each is read as
             one: a scanned stack's leading layers axis is a batch of matrices, as is the expert axis of
             a mixture's stacked kernels (each expert [D, F] or [F, D] its own matrix), an attention
             kernel [D, H, Dh] is the matrix [D, H*Dh], its output [H, Dh, D] is [H*Dh, D].
  adafactor  T5's Adafactor (optax's: factored second moments, update clipping, steps relative to
             the parameters' scale, no momentum unless asked).
  lion       Lion (optax's: the sign of the interpolated momentum).
Under muP (config.model.parametrization=mup, layers/parametrization.py) AdamW's and Lion's updates of the
hidden matrices are multiplied by 1/m (`scale_by_width`), Muon's by sqrt(fan_out / fan_in) in place of its
shape scale; Adafactor, which scales its steps by the parameters' own size, is refused.
Schedules (`config.optim.schedule`), each after a linear warmup from 0 over `warmup_steps`:
  cosine        cosine decay to lr x final_lr_fraction at the last step.
  constant      lr.
  wsd           warmup-stable-decay: lr, then over the final `decay_fraction` of the steps down to
                lr x final_lr_fraction, linearly or by 1 - sqrt (`cooldown`).
  linear        linear decay to lr x final_lr_fraction at the last step.
  inverse_sqrt  lr x sqrt(warmup / step) (the Transformer's and T5's; lr / sqrt(step) without warmup).
"""

import itertools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from transformer import sharding
from transformer.layers import lora, moe, parametrization

# Modules whose kernels meet the inputs or make the outputs, or score a mixture's experts or gate
# its shared expert: Muon leaves them to AdamW.
INPUT_OUTPUT = ("patch_embed", "unembed", "head", "router", "shared_gate")
BATCHES = (sharding.LAYERS, sharding.EXPERT)  # the axes of a stack of matrices
FROZEN = (moe.ROUTER_BIAS,)  # the last names of the parameters whose update is zero


def check(optim_config) -> None:
    """Fails naming the config.optim key whose value is not one of its choices or out of range."""
    c = optim_config
    for key, choices in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES), ("cooldown", COOLDOWNS)):
        if c[key] not in choices:
            raise ValueError(f"config.optim.{key}={c[key]!r}: choose one of {', '.join(choices)}")
    for key in ("lr", "warmup_steps", "weight_decay", "clip_norm", "final_lr_fraction", "eps", "muon_rms"):
        if c[key] < 0:
            raise ValueError(f"config.optim.{key}={c[key]} must not be negative")
    ranges = {  # key: (low, high, low included, high included)
        "b1": (0, 1, True, False), "b2": (0, 1, True, False), "decay_fraction": (0, 1, False, True),
        "muon_momentum": (0, 1, True, False), "muon_adamw_lr_scale": (0, math.inf, False, False),
        "adafactor_decay_rate": (0, 1, False, True), "adafactor_momentum": (0, 1, True, False),
        "lion_b1": (0, 1, True, False), "lion_b2": (0, 1, True, False),
    }
    for key, (low, high, low_in, high_in) in ranges.items():
        inside = (c[key] >= low if low_in else c[key] > low) and (c[key] <= high if high_in else c[key] < high)
        if not inside:
            raise ValueError(f"config.optim.{key}={c[key]} must be in {'[' if low_in else '('}{low}, "
                             f"{high}{']' if high_in else ')'}")
    if c.muon_ns_steps < 1:
        raise ValueError(f"config.optim.muon_ns_steps={c.muon_ns_steps} must be at least 1")
    if c.adafactor_clip != 0 and c.adafactor_clip < 1:
        raise ValueError(f"config.optim.adafactor_clip={c.adafactor_clip} must be at least 1 (0: no clipping)")


def check_muon(param_shapes) -> None:
    """Fails naming config.optim.optimizer where Muon finds no hidden matrix in the model's params
    (boxed shapes: `models.param_shapes`), or one whose logical axes `matrix_axes` reads wrongly: a
    batch axis that is not the layers or expert axis, a vocabulary, class, position or unnamed axis in a
    matrix, or the model width beside other axes on one side."""
    found = 0
    boxed = lambda x: isinstance(x, nn.meta.AxisMetadata)
    for path, leaf in jax.tree_util.tree_flatten_with_path(param_shapes, is_leaf=boxed)[0]:
        shape = (leaf.unbox() if boxed(leaf) else leaf).shape
        dims = matrix_axes(path, shape)
        found += dims is not None
        if dims is None or not boxed(leaf):
            continue
        names = tuple(leaf.names)
        reduction, output = _normalized(dims, len(shape))
        batch = [a for a in range(len(shape)) if a not in reduction + output]
        sides = [[names[a] for a in reduction], [names[a] for a in output]]
        if (any(names[a] not in BATCHES for a in batch) or any(n in BATCHES for n in sides[0] + sides[1])
                or any(n in (sharding.VOCAB, sharding.CLASSES, sharding.LENGTH, sharding.TYPES, None)
                       for n in sides[0] + sides[1])
                or any(sharding.EMBED in side and len(side) > 1 for side in sides)):
            raise ValueError(
                f"config.optim.optimizer=muon: parameter {_name(path)} {shape} with axes {names} is read as the "
                f"matrix {sides[0]} x {sides[1]} (batch {[names[a] for a in batch]}); teach "
                "transformer/training/optim.py's matrix_axes (or INPUT_OUTPUT) its layout")
    if not found:
        raise ValueError("config.optim.optimizer=muon: config.model has no hidden weight matrix (a 'kernel' of two or "
                         "more axes outside the embeddings and the head) for Muon to take; choose adamw")


def _cosine(c, steps: int, warmup: int, end: float) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=c.lr, warmup_steps=warmup,
                                              decay_steps=max(steps, warmup + 1), end_value=end)


def _after_warmup(c, warmup: int, *schedules, starts: tuple[int, ...] = ()) -> optax.Schedule:
    """The linear warmup from 0 to lr over `warmup` steps, then `schedules` (the later ones from `starts` on)."""
    return optax.join_schedules([optax.linear_schedule(0.0, c.lr, warmup), *schedules], [warmup, *starts])


def _constant(c, steps: int, warmup: int, end: float) -> optax.Schedule:
    return _after_warmup(c, warmup, optax.constant_schedule(c.lr))


def _linear(c, steps: int, warmup: int, end: float) -> optax.Schedule:
    return _after_warmup(c, warmup, optax.linear_schedule(c.lr, end, max(steps - warmup, 1)))


def _inverse_sqrt(c, steps: int, warmup: int, end: float) -> optax.Schedule:
    base = max(warmup, 1)  # the schedule after the warmup counts from its end: step = count + warmup
    return _after_warmup(c, warmup, lambda count: c.lr * jnp.sqrt(base / jnp.maximum(count + warmup, base)))


def _wsd(c, steps: int, warmup: int, end: float) -> optax.Schedule:
    start = max(warmup, steps - max(1, round(c.decay_fraction * steps)))
    cooldown = COOLDOWNS[c.cooldown](c.lr, end, max(steps - start, 1))
    return _after_warmup(c, warmup, optax.constant_schedule(c.lr), cooldown, starts=(start,))


SCHEDULES = {"cosine": _cosine, "constant": _constant, "wsd": _wsd, "linear": _linear, "inverse_sqrt": _inverse_sqrt}
COOLDOWNS = {  # wsd's decay: (lr, final lr, its steps) -> lr from its start on
    "linear": optax.linear_schedule,
    "1-sqrt": lambda lr, end, length: (
        lambda count: end + (lr - end) * (1 - jnp.sqrt(jnp.clip(count / length, 0, 1)))),
}


def make_schedule(optim_config, total_steps: int) -> optax.Schedule:
    """The schedule of `config.optim.schedule` (module docstring) over `total_steps`; a warmup of as
    many steps or more ends one step before the last."""
    c = optim_config
    warmup = min(c.warmup_steps, max(total_steps - 1, 0))
    return SCHEDULES[c.schedule](c, total_steps, warmup, c.lr * c.final_lr_fraction)


def _names(path) -> list[str]:
    return [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]


def _name(path) -> str:
    return "/".join(_names(path))


def decay_mask(params):
    """True for weights that take weight decay: everything but biases and norm scales, by the last name:
    a norm's `scale`, and every name ending in `bias` (a layer's `bias`, BERT's `mlm_bias`, a decoder's
    `logits_bias`, an expert's `up_bias`, T5's per-head relative-position `*_rel_bias`). Embeddings,
    position tables and ViT's class token decay."""
    def decays(path, _):
        name = _names(path)[-1]
        return name != "scale" and not name.endswith("bias")
    return jax.tree_util.tree_map_with_path(decays, params)


def matrix_axes(path, shape) -> MuonDimensionNumbers | None:
    """How Muon reads the parameter at `path` as a matrix (reduction = input axes, output axes; the
    rest, a scanned stack's leading layers axis, a batch of matrices), or None where AdamW takes it:
    anything but a `kernel` or a mixture's stacked expert kernel, the kernels of INPUT_OUTPUT, and
    kernels of fewer than two axes. An expert kernel [..., E, D, F] is E matrices over its last two
    axes. A kernel of three axes is Flax's DenseGeneral's: an attention output `out` [H, Dh, D] reduces
    over its first two, any other ([D, H, Dh]) over its first."""
    names = _names(path)
    if not names or any(n in INPUT_OUTPUT for n in names):
        return None
    if names[-1] in moe.EXPERT_KERNELS:
        return MuonDimensionNumbers(len(shape) - 2, len(shape) - 1)
    if names[-1] != "kernel":
        return None
    stacked = sum(1 for outer, inner in itertools.pairwise(names) if inner == "block" and outer.endswith("s"))
    axes = tuple(range(stacked, len(shape)))
    if len(axes) < 2:
        return None
    if len(axes) == 2:
        return MuonDimensionNumbers(axes[0], axes[1])
    if len(names) > 1 and names[-2] == "out":
        return MuonDimensionNumbers(axes[:-1], axes[-1])
    return MuonDimensionNumbers(axes[0], axes[1:])


def _normalized(dims: MuonDimensionNumbers, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    as_tuple = lambda a: tuple(x % ndim for x in ((a,) if isinstance(a, int) else a))
    return as_tuple(dims.reduction_axis), as_tuple(dims.output_axis)


def muon_labels(params):
    """'muon' for the hidden matrices (`matrix_axes`), 'adamw' for the rest."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: "adamw" if matrix_axes(path, x.shape) is None else "muon", params)


def _muon_dimension_numbers(updates):
    return jax.tree_util.tree_map_with_path(lambda path, x: matrix_axes(path, x.shape), updates)


def scale_by_shape(rms: float, mup: bool = False) -> optax.GradientTransformation:
    """An orthogonalised update of the matrix [fan_in, fan_out] times sqrt(max(fan_in, fan_out)) x rms
    (the update's RMS then is about `rms`, AdamW's: Liu et al. 2025), or with rms = 0 times
    sqrt(max(1, fan_out / fan_in)) (Keller Jordan's Muon); under muP (`mup`) times sqrt(fan_out / fan_in),
    the spectral condition that keeps the update's effect the same at every width (Megatron-LM#3715 found the
    max(fan_in, fan_out) form to break width transfer), `rms` unused."""
    def scale(update, dims):
        reduction, output = _normalized(dims, update.ndim)
        fan_in, fan_out = math.prod(update.shape[a] for a in reduction), math.prod(update.shape[a] for a in output)
        if mup:
            factor = math.sqrt(fan_out / fan_in)
        else:
            factor = math.sqrt(max(fan_in, fan_out)) * rms if rms > 0 else math.sqrt(max(1, fan_out / fan_in))
        return update * factor

    def update_fn(updates, state, params=None):
        del params
        scaled = jax.tree.map(scale, updates, _muon_dimension_numbers(updates),
                              is_leaf=lambda x: isinstance(x, MuonDimensionNumbers))
        return scaled, state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def muon(optim_config, schedule: optax.Schedule, width_mult: float | None = None) -> optax.GradientTransformation:
    """Muon for the hidden matrices (lr `schedule`), AdamW for the rest (lr `schedule` x
    muon_adamw_lr_scale), each with decoupled weight decay; under muP (`width_mult`: m) Muon's update is
    scaled by sqrt(fan_out / fan_in) and AdamW's parameters take their muP multipliers."""
    c = optim_config
    adamw = optax.adamw(lambda count: schedule(count) * c.muon_adamw_lr_scale, b1=c.b1, b2=c.b2, eps=c.eps,
                        weight_decay=c.weight_decay, mask=decay_mask)
    return optax.partition({
        "muon": optax.chain(
            scale_by_muon(ns_steps=c.muon_ns_steps, beta=c.muon_momentum, nesterov=True,
                          weight_dimension_numbers=_muon_dimension_numbers),
            scale_by_shape(c.muon_rms, mup=width_mult is not None),
            optax.add_decayed_weights(c.weight_decay),
            optax.scale_by_learning_rate(schedule)),
        "adamw": adamw if width_mult is None else optax.chain(adamw, scale_by_width(width_mult)),
    }, muon_labels)


def scale_by_width(width_mult: float) -> optax.GradientTransformation:
    """Each update times its parameter's muP learning-rate multiplier (`parametrization.lr_multiplier`: 1/m for
    the hidden matrices, 1 for the rest): after AdamW or Lion, the per-parameter lr x multiplier (and the
    decoupled weight decay with it, as PyTorch's per-group lr does)."""
    def multiplier(path, x):
        return parametrization.lr_multiplier(_names(path), x.ndim, width_mult)

    def update_fn(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(lambda path, u: u * multiplier(path, u), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def adafactor(optim_config, schedule: optax.Schedule) -> optax.GradientTransformation:
    """optax's Adafactor (T5's form) plus decoupled weight decay lr x weight_decay x w."""
    c = optim_config
    decay = (lambda count: schedule(count) * c.weight_decay) if c.weight_decay else None
    return optax.adafactor(schedule, decay_rate=c.adafactor_decay_rate, clipping_threshold=c.adafactor_clip or None,
                           momentum=c.adafactor_momentum or None, weight_decay_rate=decay, weight_decay_mask=decay_mask)


def placeable(state):
    """An optimizer state made from boxed params, with the logical-axis boxes its statistics took from
    their parameters kept only on arrays of the parameter's rank and more than one element: a
    masked-out entry (Muon's partition), a factored statistic (Adafactor's row and column) or
    an empty optax.MaskedNode is left bare, so replicated, for its parameter's names cannot place it."""
    def fix(x):
        if isinstance(x, nn.meta.AxisMetadata):
            value = x.unbox()
            if not hasattr(value, "ndim") or value.ndim != len(x.names) or value.size <= 1:
                return value
        return x
    return jax.tree.map(fix, state, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def _adamw(c, schedule: optax.Schedule) -> optax.GradientTransformation:
    return optax.adamw(schedule, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay, mask=decay_mask)


def _lion(c, schedule: optax.Schedule) -> optax.GradientTransformation:
    return optax.lion(schedule, b1=c.lion_b1, b2=c.lion_b2, weight_decay=c.weight_decay, mask=decay_mask)


OPTIMIZERS = {"adamw": _adamw, "muon": muon, "adafactor": adafactor, "lion": _lion}


def frozen(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` with a zero update for the `FROZEN` parameters, its state unchanged."""
    def update_fn(updates, state, params=None):
        updates, state = tx.update(updates, state, params)
        still = lambda path, u: jnp.zeros_like(u) if _names(path)[-1] in FROZEN else u  # noqa: E731
        return jax.tree_util.tree_map_with_path(still, updates), state
    return tx._replace(update=update_fn)


def make_optimizer(optim_config, total_steps: int, adapters_only: bool = False, width_mult: float | None = None
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(global-norm clipping then config.optim.optimizer's update, `FROZEN` left alone (`adapters_only`:
    everything but the LoRA adapters, which alone have optimizer state); its learning-rate schedule).
    `width_mult` (muP's m = d_model / mup_base_width; None under sp) gives each parameter its muP scale."""
    c = optim_config
    check(c)
    schedule = make_schedule(c, total_steps)
    clip = optax.clip_by_global_norm(c.clip_norm) if c.clip_norm > 0 else optax.identity()
    if width_mult is None:
        update = OPTIMIZERS[c.optimizer](c, schedule)
    elif c.optimizer == "muon":
        update = muon(c, schedule, width_mult)
    elif c.optimizer in ("adamw", "lion"):
        update = optax.chain(OPTIMIZERS[c.optimizer](c, schedule), scale_by_width(width_mult))
    else:
        raise ValueError(f"config.optim.optimizer={c.optimizer} has no muP learning-rate rule here: choose adamw, "
                         "lion or muon, or config.model.parametrization=sp")
    tx = frozen(optax.chain(clip, update))
    if adapters_only:
        tx = lora.trainable_only(tx)
    return tx._replace(init=lambda params: placeable(tx.init(params))), schedule
