"""What runs on which platform, chosen here and nowhere else: `auto`, `flash`, and the kernel that
runs blockwise attention's blocks (`BLOCKS`, for `blockwise` and each hop of `ring`).

Glossary of shapes: B batch, L queries, S keys, H heads, K kv heads, Dh head width.

  platform     auto (the default)                 flash                          blockwise, ring
  NVIDIA GPU   cuDNN (`kernels/cudnn.py`) for the calls it takes, the Pallas     the Pallas kernel
               kernel (`kernels/pallas_gpu.py`) for every other: documents,
               padding that cuDNN's lengths cannot say, globals, block-sparse
               tables, a bias, L != S causal, float32, shapes cuDNN cannot plan
  TPU          XLA (`xla.py`)                     splash (`kernels/splash.py`)   XLA's scan
                                                  for what it takes, else
                                                  blockwise
  CPU          XLA (`xla.py`: causal query        blockwise (no kernel here)     XLA's scan
               blocks)

A decode step (one new token a row over the cache, `decode`) runs jax's paged kernel on a TPU or an NVIDIA
GPU (`kernels/paged.py`) under auto and flash where it takes the step, else what the table says.

The choice is `jax.lax.platform_dependent`: every branch is traced and the platform the program is
lowered for keeps its own, so a CUDA lowering on a CPU machine holds the GPU's choice. Within the
GPU's branch cuDNN's refusals are known when it is traced (`cudnn.refusal`); one that shows only
then (a ValueError from jax.nn) falls to the kernel all the same. Each fallback is said once per
reason, on the platform it happens on.
"""

import dataclasses
import functools
import math
import sys

import jax
from jax.sharding import PartitionSpec as P

from transformer import sharding
from transformer.layers.attention import blockwise, xla
from transformer.layers.attention.kernels import cudnn, paged, pallas_gpu, splash
from transformer.layers.attention.masks import Mask
from transformer.sharding import BATCH, HEAD_DIM, HEADS

_SAID: set[str] = set()
platform = jax.default_backend  # where this process computes (a seam for tests that fake a GPU)


def auto(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, block: int = 512) -> jax.Array:
    """`model.attention=auto`: q [B, L, H, Dh], k, v [B, S, K, Dh] -> [B, L, H, Dh]."""
    return jax.lax.platform_dependent(q, k, v, mask, cuda=functools.partial(gpu, block=block, name="auto"),
                                      tpu=functools.partial(tpu, block=block, name="auto"),
                                      default=functools.partial(xla.attention, block=block))


def flash(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, block: int = 512) -> jax.Array:
    """`model.attention=flash`: q [B, L, H, Dh], k, v [B, S, K, Dh] -> [B, L, H, Dh]."""
    return jax.lax.platform_dependent(q, k, v, mask, cuda=functools.partial(gpu, block=block, name="flash"),
                                      tpu=functools.partial(tpu, block=block),
                                      default=functools.partial(cpu, block=block))


@dataclasses.dataclass(frozen=True)
class PerPlatform:
    """Blockwise attention's kernel (`blockwise.Kernel`): the Pallas kernel where the program is lowered
    for an NVIDIA GPU, XLA's scan elsewhere."""

    def forward(self, plan: blockwise.Plan, x: blockwise.Operands):
        return jax.lax.platform_dependent(x, cuda=functools.partial(pallas_gpu.Flash().forward, plan),
                                          default=functools.partial(blockwise.SCAN.forward, plan))

    def backward(self, plan: blockwise.Plan, x: blockwise.Operands, lse, delta, d_out):
        return jax.lax.platform_dependent(x, lse, delta, d_out,
                                          cuda=functools.partial(pallas_gpu.Flash().backward, plan),
                                          default=functools.partial(blockwise.SCAN.backward, plan))


BLOCKS = PerPlatform()


def gpu(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, block: int = 512, name: str = "flash") -> jax.Array:
    """cuDNN where it takes the call, else the Pallas kernel (said once where this is a GPU)."""
    kernel = functools.partial(on_shards, blockwise.attention, block=pallas_gpu.FORWARD_TILES[0],
                               kernel=pallas_gpu.Flash())
    reason = cudnn.refusal(q, k, mask)
    if reason is None:
        try:
            return cudnn.attention(q, k, v, mask, otherwise=kernel)
        except (NotImplementedError, ValueError, RuntimeError) as error:
            reason = f"cuDNN refused it ({type(error).__name__}: {error})"
    _say(f"model.attention={name}: {reason}; using the Pallas kernel", on="gpu")
    return kernel(q, k, v, mask)


def tpu(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, block: int = 512, name: str = "flash") -> jax.Array:
    """Splash where it takes the call, each device on its shard (a Mosaic kernel cannot be partitioned), else
    XLA's attention for auto and blockwise for flash (said once on a TPU)."""
    reason = splash.refusal(q, k, mask)
    if reason is None:
        return on_shards(splash.attention, q, k, v, mask)
    if name == "auto":
        _say(f"model.attention=auto: {reason}; using XLA's attention", on="tpu")
        return xla.attention(q, k, v, mask, block=block)
    _say(f"model.attention=flash: {reason}; using blockwise attention", on="tpu")
    return blockwise.attention(q, k, v, mask, block, kernel=BLOCKS)


def decode(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, mask: Mask, otherwise) -> jax.Array:
    """A decode step's attention for `auto` and `flash`: q [B, 1, H, Dh] over the head-major cache k, v
    [B, K, C, Dh] of which each row holds `lengths` [B] (or () for all) keys, as `mask` (causal, the cache's
    positions, nothing else) also says: the paged kernel on a TPU or an NVIDIA GPU where it takes the step
    (`kernels/paged.py`), else `otherwise(q, k, v, lengths, mask)` (said once on the platform)."""
    return jax.lax.platform_dependent(q, k, v, lengths, mask, cuda=functools.partial(paged_step, "gpu", otherwise),
                                      tpu=functools.partial(paged_step, "tpu", otherwise), default=otherwise)


def paged_step(name: str, otherwise, q, k, v, lengths, mask: Mask) -> jax.Array:
    """`decode` on platform `name` ('tpu' or 'gpu'): the paged kernel, or `otherwise` with the reason said once."""
    reason = paged.refusal(q, k, name)
    if reason is None and not mask.replace(causal=False, query_positions=None, key_positions=None).allows_all:
        reason = "the mask has more than the cache's causal positions"
    if reason is not None:
        _say(f"decode attention: {reason}; not the paged kernel", on=name)
        return otherwise(q, k, v, lengths, mask)
    return PAGED[name](q, k, v, lengths)


PAGED = {"tpu": paged.rows_merged(paged.tpu), "gpu": paged.rows_merged(paged.gpu)}


def cpu(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, block: int = 512) -> jax.Array:
    """No flash kernel: blockwise (said once where this is the platform)."""
    _say(f"model.attention=flash: no flash kernel on {platform()}; using blockwise attention", on=platform())
    return blockwise.attention(q, k, v, mask, block, kernel=BLOCKS)


def on_shards(fn, q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, **kwargs) -> jax.Array:
    """fn(q, k, v, mask, **kwargs) run by each device on its part of the batch and heads where a step is
    traced on a mesh (`jax.shard_map`): a Triton or Mosaic call has no partitioning rule, and XLA would gather
    its operands whole onto every device. The length stays whole (splitting it is ring attention's
    work), and so do the heads where a bias needs them all (a `per_head` bias splits with them). A batch or
    heads that the mesh does not split (a decode row of one) run whole."""
    active = sharding.active()
    if active is None or active[0].size == 1:
        return fn(q, k, v, mask, **kwargs)
    mesh, rules = active
    spec = lambda *axes: sharding.mesh_spec(axes, rules)
    rows = lambda x: None if x is None else spec(BATCH, None)
    whole = lambda x: jax.tree.map(lambda _: P(), x)
    split_heads = mask.bias is None or mask.bias.per_head
    specs = mask.replace(key_valid=rows(mask.key_valid), segments=rows(mask.segments),
                         key_segments=rows(mask.key_segments), query_positions=whole(mask.query_positions),
                         key_positions=whole(mask.key_positions), bias=bias_specs(mask.bias, rules))
    qkv = spec(BATCH, None, HEADS if split_heads else None, HEAD_DIM)
    if not all(divides(mesh, axes, size) for axes, size in zip(qkv, q.shape)):  # a batch of 1 on a data mesh
        return fn(q, k, v, mask, **kwargs)
    return jax.shard_map(functools.partial(fn, **kwargs), mesh=mesh, in_specs=(qkv, qkv, qkv, specs),
                         out_specs=qkv, check_vma=False)(q, k, v, mask)  # no collectives to check


def divides(mesh, axes, size: int) -> bool:
    """Whether the mesh axes `axes` (a PartitionSpec entry: None, a name or a tuple of names) split `size`."""
    names = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return size % math.prod(mesh.shape[name] for name in names) == 0


def bias_specs(bias, rules):
    """The PartitionSpecs of a mask's bias (None: none) inside `jax.shard_map`: a `per_head` bias's leaves split
    over the mesh axes the heads are, on their first axis; any other whole on every device."""
    if bias is None:
        return None
    if not bias.per_head:
        return jax.tree.map(lambda _: P(), bias)
    return bias.replace(params=jax.tree.map(
        lambda x: sharding.mesh_spec((HEADS, *[None] * (x.ndim - 1)), rules), bias.params))


def _say(message: str, on: str) -> None:
    """`message` once per process, where `on` is the platform JAX computes on (the other platforms'
    branches are traced too, and say nothing)."""
    if platform() == on and message not in _SAID:
        _SAID.add(message)
        print(message, file=sys.stderr)
