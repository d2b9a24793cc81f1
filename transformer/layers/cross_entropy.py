"""Cross entropy at a model's output, in float32, and a language model's head with its loss over
blocks of positions.

Glossary of shapes: V classes (the vocabulary, or a classifier's labels); `...` any leading
dimensions (batch, length); B batch, L length, D width, n blocks of c positions (n c = L).
Targets are integer ids [...] or, for soft targets (mixup, distillation), distributions [..., V].

A language model's head over a long context is where the memory goes: at L = 32,768 and a
128,256-token vocabulary one row's float32 logits are 16 GiB, and their gradient as much again.
`blockwise_token_losses` computes the head and the loss over blocks of positions instead, each
block's logits made again in the backward pass, so that only one block's [B, c, V] is ever held.
The tasks' weighted losses (`transformer.training.losses`) are built on `token_losses`.
"""

import jax
import jax.numpy as jnp
import optax


def token_losses(logits: jax.Array, targets: jax.Array, smoothing: float = 0.0, fused_backward: bool = False,
                 log_z: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Per-item cross entropy in float32: logits [..., V], targets [...] ids or [..., V] -> [...]; with
    `log_z`, the pair (it, log Z = logsumexp(logits) [...]), whose square is PaLM's z-loss.

    `smoothing` mixes the targets with the uniform distribution (label smoothing).
    `fused_backward` takes `integer_cross_entropy` for integer targets (same numbers): for a head
    that computes in bf16/f16, whose cast of the logits' gradient its backward joins. A float32
    head keeps autodiff's, which XLA:CPU makes faster there (its weight gradient wants the logits'
    gradient transposed, and a transposing copy that also computes the softmax runs at a
    fraction of a plain one's speed).
    """
    logits = logits.astype(jnp.float32)
    losses = _cross_entropy(logits, targets, smoothing, fused_backward)
    return (losses, log_partition(logits)) if log_z else losses


def log_partition(logits: jax.Array) -> jax.Array:
    """log Z = logsumexp(logits) [...] in float32 of logits [..., V]: the softmax's log normaliser."""
    return jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)


def _cross_entropy(logits: jax.Array, targets: jax.Array, smoothing: float, fused_backward: bool) -> jax.Array:
    if targets.ndim == logits.ndim:
        return optax.softmax_cross_entropy(logits, optax.smooth_labels(targets.astype(jnp.float32), smoothing))
    if smoothing:
        return optax.softmax_cross_entropy(
            logits, optax.smooth_labels(jax.nn.one_hot(targets, logits.shape[-1]), smoothing))
    if fused_backward:
        return integer_cross_entropy(logits, targets)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


@jax.custom_vjp
def integer_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """`optax.softmax_cross_entropy_with_integer_labels(logits, targets)`, the same numbers both ways,
    with a backward that is one elementwise pass over the logits: logits [..., V] float32, targets
    [...] ids -> [...].

    Autodiff of optax's keeps exp(logits - max) [..., V] from the forward and takes three more passes
    over [..., V] in the backward (the softmax, a scatter of the targets' -1, a cast for a bf16
    head's product): at a GPT's head they are the largest arrays of the step (128 MiB at 4,096
    positions and 8,192 classes). Here the gradient, exp(logits - max) * g / sum - g [target], is
    elementwise, one fusion with the head's cast. The same operations in the same order as
    autodiff's: the results are equal, float32 and bf16 (tests/test_losses.py).
    """
    return _cross_entropy_fwd(logits, targets)[0]


def _cross_entropy_fwd(logits, targets):
    amax = jnp.max(logits, axis=-1)
    amax = jnp.where(jnp.isfinite(amax), amax, 0.0)  # [...]
    sumexp = jnp.abs(jnp.exp(logits - amax[..., None]).sum(axis=-1))  # [...]
    label = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [...]
    return jnp.log(sumexp) + amax - label, (logits, targets, amax, sumexp)


def _cross_entropy_bwd(residuals, g):
    logits, targets, amax, sumexp = residuals
    grad = jnp.exp(logits - amax[..., None]) * (g / sumexp)[..., None]  # [..., V]
    is_target = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1) == targets[..., None]
    return jnp.where(is_target, grad - g[..., None], grad), None


integer_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def blockwise_token_losses(head, x: jax.Array, targets: jax.Array, loss_block: int, fused_backward: bool = False,
                           log_z: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`token_losses(head(x), targets, fused_backward=..., log_z=...)` [B, L] (or a pair of them), holding
    at most one block's logits.

    `head` maps hidden states [..., D] to float32 logits [..., V]; `x` [B, L, D]; `targets`
    [B, L] ids. Block j holds the positions j, j + n, j + 2n, ... of every row (n blocks of
    c <= `loss_block` positions, the fewest that divide L), so that a length split over devices
    (ring attention's context axis) stays split in each block. The blocks run one after
    another (`lax.scan`), each rematerialised in the backward pass: the head's forward product
    is computed twice, and nothing of size V is saved. L <= `loss_block` is one block: the plain
    `token_losses(head(x), targets)`.
    """
    (b, length, width), blocks = x.shape, _blocks(x.shape[1], loss_block)
    if blocks == 1:
        return token_losses(head(x), targets, fused_backward=fused_backward, log_z=log_z)
    xs = jnp.moveaxis(x.reshape(b, length // blocks, blocks, width), 2, 0)  # [n, B, c, D]
    ts = jnp.moveaxis(targets.reshape(b, length // blocks, blocks), 2, 0)  # [n, B, c]

    @jax.checkpoint
    def one(xt):
        return token_losses(head(xt[0]), xt[1], fused_backward=fused_backward, log_z=log_z)  # [B, c] (each)

    _, losses = jax.lax.scan(lambda carry, xt: (carry, one(xt)), None, (xs, ts))  # [n, B, c] (each)
    return jax.tree.map(lambda per_block: jnp.moveaxis(per_block, 0, 2).reshape(b, length), losses)


def _blocks(length: int, block: int) -> int:
    """The fewest blocks n that divide `length` with length / n <= block."""
    if block < 1:
        raise ValueError(f"a loss block of {block} positions: it must be positive")
    return next(n for n in range(-(-length // block), length + 1) if length % n == 0)
