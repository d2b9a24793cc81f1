"""Model FLOPs utilisation: the training FLOPs of a step (models/flops.py's formula) against the peak
FLOP/s of the devices that run it.

  flops_per_step, peak, described = model_flops(config, mesh)
  value, note = Utilisation(flops_per_step, peak)(steps, seconds)   # the loop's `train/mfu`, at most 1
  peak, described = device_peak("bfloat16")                         # one device: datasheet or measured

A device's peak is its datasheet's (PEAK_FLOPS, by `device_kind` and compute dtype) where known, else
(CPUs, unknown accelerators) the best of several timings of a matmul, measured once per machine and kept
in the user's cache (`console.user_cache("peaks.json")`). `train/mfu`
cannot exceed 1: where steps run faster than the peak (a measured peak taken while the machine was
busy; a datasheet peak beaten would mean the FLOPs formula overcounts), the peak is raised to their
rate for the rest of the launch, and the loop says so on stderr.
"""

import functools
import json
import os
import time

import jax
import jax.numpy as jnp

from transformer import console
from transformer.models.flops import training_flops

# Nominal dense peak FLOP/s per device by compute dtype (vendor datasheets; float32 on NVIDIA
# is the TF32 tensor-core rate, on TPU the default-precision matmul rate, i.e. bf16 passes).
PEAK_FLOPS = {
    "h100": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "h200": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "a100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
    "tpu v4": {"bfloat16": 275e12, "float32": 275e12},
    "tpu v5 lite": {"bfloat16": 197e12, "float32": 197e12},  # v5e reports "TPU v5 lite"
    "tpu v5e": {"bfloat16": 197e12, "float32": 197e12},
    "tpu v5p": {"bfloat16": 459e12, "float32": 459e12},
    "tpu v5": {"bfloat16": 459e12, "float32": 459e12},
}


# Memory bandwidth per GPU, bytes/s (datasheets: SXM parts), what a decode step's MBU is measured against;
# a TPU chip's is in training/topology.py's CHIPS.
PEAK_BANDWIDTH = {"h100": 3.35e12, "h200": 4.8e12, "a100": 2.039e12}


def nominal_bandwidth(device_kind: str) -> float | None:
    """The datasheet memory bandwidth of GPU `device_kind` in bytes/s; None if unknown."""
    return next((v for k, v in PEAK_BANDWIDTH.items() if k in device_kind.lower()), None)


def nominal_peak(device_kind: str, dtype: str) -> float | None:
    """The datasheet peak for `device_kind` (e.g. 'NVIDIA H100 80GB HBM3') in `dtype`; None if unknown."""
    kind = device_kind.lower()
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # "tpu v5 lite" before "tpu v5"
        if key in kind:
            return PEAK_FLOPS[key].get(dtype)
    return None


def best_time(fn, reps: int) -> float:
    """The shortest of `reps` timings of fn(): the one least slowed by other work on the machine."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


@functools.cache
def measured_matmul_peak(dtype: str, n: int | None = None, reps: int = 10) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (float32 accumulation) on one device, the best of `reps`."""
    n = n or (1024 if jax.devices()[0].platform == "cpu" else 8192)
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    mm(a, a).block_until_ready()
    return 2 * n**3 / best_time(lambda: mm(a, a).block_until_ready(), reps)


@functools.cache
def measured_bandwidth(megabytes: int = 256, reps: int = 10) -> float:
    """Bytes/s one device reads in a vector-matrix product over `megabytes` of float32 (a batch-1 decode
    step's work), the best of `reps`."""
    side = int((megabytes * 2**18) ** 0.5)
    m, v = jnp.ones((side, side), jnp.float32), jnp.ones((1, side), jnp.float32)
    step = jax.jit(jnp.matmul)
    step(v, m).block_until_ready()
    return m.nbytes / best_time(lambda: step(v, m).block_until_ready(), reps)


def device_peak(dtype: str) -> tuple[float, str]:
    """(peak FLOP/s of one device in `dtype`, what it is): the datasheet's where known, else
    (CPUs, unknown accelerators) a matmul measured on this machine."""
    kind = jax.devices()[0].device_kind
    peak = nominal_peak(kind, dtype)
    if peak:
        return peak, f"nominal {kind} {dtype} peak {peak / 1e12:,.0f} TFLOP/s"
    peak = kept_matmul_peak(kind, dtype)
    return peak, (f"a {dtype} matmul measured on one {kind} device (best of several, kept in "
                  f"{console.user_cache('peaks.json')}): {peak / 1e9:,.1f} GFLOP/s, raised to any faster step")


def kept_matmul_peak(kind: str, dtype: str) -> float:
    """measured_matmul_peak, measured once per device kind, dtype and core count and then read from the
    user's cache, so that a launch does not spend a second timing a matmul."""
    path, key = console.user_cache("peaks.json"), f"{kind}|{dtype}|{os.cpu_count()}"
    try:
        with open(path) as f:
            kept = json.load(f)
    except (OSError, ValueError):
        kept = {}
    if key not in kept:
        kept[key] = measured_matmul_peak(dtype)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(f"{path}.{os.getpid()}.tmp", "w") as f:
                json.dump(kept, f)
            os.replace(f"{path}.{os.getpid()}.tmp", path)
        except OSError:
            pass
    return kept[key]


def model_flops(config, mesh, param_shapes=None) -> tuple[float, float, str]:
    """(training FLOPs per step, the mesh's peak FLOP/s, what the peak is) for `train/mfu`; `param_shapes`
    as `forward_flops` takes them (models/flops.py)."""
    peak, described = device_peak(config.model.get("dtype", "float32"))
    return training_flops(config, param_shapes), peak * mesh.size, described


class Utilisation:
    """`train/mfu` of the steps since the last log: their model FLOP/s over `peak` (the mesh's), raised to
    their rate where they beat it, so that the value is at most 1 by construction."""

    def __init__(self, flops_per_step: float, peak: float):
        self.flops_per_step, self.peak = flops_per_step, peak

    def __call__(self, steps: int, seconds: float) -> tuple[float, str | None]:
        """(utilisation of `steps` steps that took `seconds`, a line saying so where the peak was raised)."""
        achieved = self.flops_per_step * steps / seconds
        if achieved <= self.peak:
            return achieved / self.peak, None
        note = (f"train/mfu: steps ran at {achieved / 1e9:,.1f} GFLOP/s, above the peak of {self.peak / 1e9:,.1f} "
                "(a measured peak: the machine was busier at launch; a datasheet's: the FLOPs formula overcounts); "
                "the peak is now their rate")
        self.peak = achieved
        return 1.0, note
