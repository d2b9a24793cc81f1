"""Will the train step fit: the compiled step's memory against the device's, before any step runs.

The step is compiled from shapes alone (nothing allocated); `memory_analysis()` then says what one
device holds while it runs: its arguments (the donated state and the batch), the outputs that do
not reuse the donated buffers, its temporaries and its code. That is compared with what the device
has: `config.train.memory_limit_gb` where set (how a test fakes a small device on a CPU), else the
device's own allocator limit less what is in use (`memory_stats()`), or for a CPU device, which reports
none, its share of the host's memory. A step that cannot fit stops the run in one line naming what to set,
exit code 2, as every user error does; `model.remat=auto` compiles the policies from the lightest
(`REMAT_ORDER`: no recomputation) on and keeps the first that fits.
"""

import os
from collections.abc import Callable

import jax

from transformer.layers import lora

GiB = 2**30
REMAT_ORDER = ("none", "save_dots", "full")  # from the least recomputation to the least memory


class DoesNotFit(ValueError):
    """A step larger than the device (a user error: the message says what to set)."""


def host_bytes() -> int:
    """This host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available(memory_limit_gb: float, device) -> int | None:
    """Bytes a step may take on `device`: `memory_limit_gb` where > 0, else the device's allocator limit
    less what is in use; a CPU device its share of the host's memory; None where a platform reports no limit."""
    if memory_limit_gb > 0:
        return int(memory_limit_gb * GiB)
    if device.platform == "cpu":
        return host_bytes() // len(jax.local_devices(backend="cpu"))
    try:
        stats = device.memory_stats()
    except Exception:  # a platform without the call
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def needed(compiled) -> int:
    """Bytes the compiled program holds on one device while it runs (donated arguments counted once)."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
            + m.generated_code_size_in_bytes)


def fitting(compile_step: Callable[[str], object], remat: str, limit: int | None, accum_steps: int):
    """(policy, compiled step, bytes) of the first of `remat`'s policies (all of REMAT_ORDER for 'auto')
    whose step fits in `limit` bytes; DoesNotFit naming what to set where none does."""
    tried = []
    for policy in REMAT_ORDER if remat == "auto" else (remat,):
        compiled = compile_step(policy)
        size = needed(compiled)
        if limit is None or size <= limit:
            return policy, compiled, size
        tried.append(f"model.remat={policy} {size / GiB:.2f} GiB")
    lighter = "" if remat in ("auto", "full") else "model.remat=auto (the lightest recomputation that fits), "
    raise DoesNotFit(f"the train step does not fit in the device's {limit / GiB:.2f} GiB ({', '.join(tried)}): "
                     f"set {lighter}a smaller data.batch_size or optim.accum_steps={2 * accum_steps} "
                     "(config.train.memory_limit_gb sets the limit by hand)")


def describe(policy: str, remat: str, size: int, limit: int | None) -> str:
    """The line a run prints about its step's memory."""
    chosen = f"model.remat={policy}" + (" (auto: the lightest that fits)" if remat == "auto" else "")
    of = f" of {limit / GiB:.2f} GiB" if limit is not None else " (this platform reports no limit)"
    return f"memory: the train step takes {size / GiB:.2f} GiB a device{of}, {chosen}"


def trainable(state) -> str:
    """The line a run prints about what trains: its trainable parameters (LoRA's adapters alone, where it has
    them) of all, and the optimizer state's bytes."""
    trained, total = lora.count(state.params)
    opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state))
    return (f"parameters: {trained:,} trainable of {total:,} ({100 * trained / total:.2f}%); "
            f"optimizer state {opt_bytes / 2**20:,.1f} MiB")


def abstract_batch(local_batch: dict, sharding: jax.sharding.Sharding, batch_size: int) -> dict:
    """A batch's global shapes (leading dimension `batch_size`) from this process's rows, placed as
    `sharding`: what the step compiles against before any batch is on the devices."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((batch_size, *x.shape[1:]), x.dtype, sharding=sharding),
                        local_batch)


def example_tokens(config) -> int:
    """The positions one example puts through the model: its lengths in config.data (seq_len, or
    source_len + target_len), else an image's patches."""
    lengths = [config.data[key] for key in ("seq_len", "source_len", "target_len") if key in config.data]
    if lengths:
        return sum(lengths)
    return (config.model.image_size // config.model.patch_size) ** 2


def check_batch(config, mesh) -> None:
    """Before any data is read: a step's batch whose residual stream alone (one layer's activations, [B /
    accum_steps, L, D] in model.dtype) is larger than the memory of every device of the mesh (a CPU: its
    host's) fails in one line naming config.data.batch_size."""
    d, accum = config.data, config.optim.accum_steps
    itemsize = jax.numpy.dtype(config.model.get("dtype", "float32")).itemsize
    tokens = example_tokens(config)
    least = d.batch_size // accum * tokens * config.model.d_model * itemsize
    device = mesh.devices.flat[0]
    if device.platform == "cpu":
        held, where = host_bytes() * jax.process_count(), "host's"
    else:
        each = available(config.train.memory_limit_gb, device)
        if each is None:
            return
        held, where = each * mesh.size, f"{mesh.size} devices'"
    if least > held:
        raise ValueError(f"config.data.batch_size={d.batch_size}: one layer's activations of a step take at least "
                         f"{least / GiB:,.1f} GiB ({d.batch_size // accum:,} rows x {tokens:,} tokens x d_model "
                         f"{config.model.d_model} x {itemsize} bytes), more than the {held / GiB:,.1f} GiB of this "
                         f"{where} memory: lower it, or raise config.optim.accum_steps={accum}")
