"""A run's steps compiled for a TPU slice (or H100s) this machine does not have (MaxText's train_compile.py).

With libtpu installed (`pip install -e '.[tpu]'`), `jax.experimental.topologies` gives the devices of a slice
on a CPU machine, several hosts' included, and the run's own train step (`loop.train_step_for`: its mesh, rules,
remat and dtype, over batches of its task) is lowered over them and compiled by the TPU compiler. Per chip, the
compiled program says its arguments, outputs, temporaries and peak against the chip's HBM (a step the compiler
cannot fit is its own answer: the bytes it asked for), the FLOPs and bytes it moves (its cost analysis: a Mosaic
kernel such as splash counts none, a scanned loop's body once) and so a roofline time at the chip's published
peak. The same for H100s through jax's CUDA plugin and XLA's description of the GPU (`h100:8`; no cost
analysis there, so no roofline). The largest batch that fits is guessed from two compiles (a step's memory is
nearly affine in its batch) and compiled; where it does not fit (remat's schedules are not affine), guessed again
from it, up to four compiles (`checked_largest`). A causal language model's decode call, the engine's own (a
cache of model.max_len), is compiled too.

    python -m transformer.inspect --config configs/gpt.py:tiny --topology v5e:2x2
"""

import dataclasses
import importlib.util
import math
import os
import re
import tempfile

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from transformer import models, parallel, sharding
from transformer.models import common
from transformer.models.flops import forward_flops
from transformer.training import loop, memory, optim, tasks

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU chip's published numbers."""

    kind: str               # jax's device_kind for it
    hbm_gib: float
    bf16_flops: float       # dense bfloat16 peak, FLOP/s
    hbm_bandwidth: float    # bytes/s


# Per chip, from Google Cloud's "TPU v4" / "TPU v5e" / "TPU v5p" / "TPU v6e" pages (cloud.google.com/tpu/docs/v4,
# /v5e, /v5p, /v6e, "System architecture": HBM capacity, HBM bandwidth, peak bf16 compute).
CHIPS = {
    "v4": Chip("TPU v4", 32, 275e12, 1200e9),
    "v5e": Chip("TPU v5 lite", 16, 197e12, 819e9),
    "v5p": Chip("TPU v5", 95, 459e12, 2765e9),
    "v6e": Chip("TPU v6 lite", 32, 918e12, 1640e9),
}
# H100 SXM (nvidia.com/en-us/data-center/h100: 80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s dense bf16), compiled by jax's
# CUDA plugin without a GPU from XLA's description of the device (xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb)
GPUS = {"h100": Chip("NVIDIA H100 80GB HBM3", 79.1, 989e12, 3352e9)}
H100_TARGET = """gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535 memory_bandwidth: 3352320000000
  l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536 }
runtime_version { major: 12 minor: 8 patch: 0 } platform_name: "CUDA" dnn_version_info { major: 9 minor: 7 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
EXAMPLES = "v5e:2x2, v5e:2x4, v5p:2x2x1, v6e:2x4, v5p:4x4x4 (16 hosts), h100:8"
# what an out-of-memory compile asked for, in its two wordings
_OOM = re.compile(r"(?:Used |HLO temporaries \()([\d.]+)([KMGT]?)(?: of [\d.]+[KMGT]? hbm|\) exceeds)")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def devices(name: str, slices: int = 1) -> list:
    """The devices of TPU topology `name` (e.g. v5e:2x2), every host's, of `slices` such slices (joined by
    DCN); ValueError in one line where it is not one or libtpu is missing."""
    chip, _, shape = name.partition(":")
    if chip in GPUS:
        if slices > 1:
            raise ValueError(f"--num_slices={slices}: slices joined by DCN are TPU slices; h100:N takes N GPUs")
        return gpu_devices(name, shape)
    if chip not in CHIPS or not shape:
        raise ValueError(f"--topology={name}: a TPU chip ({', '.join(CHIPS)}) and its shape, or h100:N; "
                         f"e.g. {EXAMPLES}")
    if importlib.util.find_spec("libtpu") is None:
        raise ValueError(f"--topology={name} compiles with libtpu, which is not installed: pip install -e '.[tpu]'")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several processes may load it at once
    from jax.experimental import topologies
    try:
        more = {"num_slices": slices} if slices > 1 else {}
        return list(topologies.get_topology_desc(topology_name=name, platform="tpu", **more).devices)
    except Exception as error:  # noqa: BLE001 (libtpu's own error, said in one line)
        said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--topology={name}: libtpu cannot make it ({said}); e.g. {EXAMPLES}") from None


def gpu_devices(name: str, count: str) -> list:
    """N H100s (8 a host) for the CUDA compiler, no GPU needed: jax's CUDA plugin (jax-cuda12-plugin)."""
    if not count.isdigit() or int(count) < 1 or (int(count) > 8 and int(count) % 8):
        raise ValueError(f"--topology={name}: h100:N takes N GPUs (1 to 8, or a multiple of 8: 8 a host)")
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        raise ValueError(f"--topology={name} compiles with jax's CUDA plugin, which is not installed: "
                         "pip install -e '.[gpu-aot]'")
    n = int(count)
    from jax.experimental import topologies
    try:
        return list(topologies.get_topology_desc(name, "cuda", target_config=H100_TARGET,
                                                 topology=f"1x{max(n // 8, 1)}x{min(n, 8)}").devices)
    except NotImplementedError:  # the plugin failed to start (no GPU) and jax dropped it
        raise ValueError(f"--topology={name}: jax dropped its CUDA plugin on this machine without a GPU: run "
                         "with JAX_PLATFORMS=cpu") from None


def chip_of(devices: list) -> Chip:
    kind = devices[0].device_kind
    return next(c for c in (*CHIPS.values(), *GPUS.values()) if c.kind == kind)


@dataclasses.dataclass
class Program:
    """What the TPU compiler said of one step at one batch, per chip (bytes; None where it did not fit)."""

    batch: int
    peak: int                   # argument + output - aliased + temporaries + code, or the bytes an OOM asked for
    fits: bool
    arguments: int | None = None
    outputs: int | None = None
    temporaries: int | None = None
    flops: float | None = None
    bytes_accessed: float | None = None
    hlo: str = ""


def program(compile_fn, batch: int, keep_hlo: bool = False) -> Program:
    """Compiles `compile_fn(batch)`; a program the compiler cannot fit in HBM is `fits=False` with the bytes it
    asked for."""
    try:
        compiled = compile_fn(batch)
    except Exception as error:  # noqa: BLE001 (an XlaRuntimeError; any other is raised again)
        used = _OOM.search(str(error))
        if "RESOURCE_EXHAUSTED" not in str(error) or used is None:
            raise
        return Program(batch, int(float(used[1]) * _UNITS[used[2]]), fits=False)
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list | tuple) else cost) or {}
    return Program(batch, memory.needed(compiled), True, m.argument_size_in_bytes,
                   m.output_size_in_bytes - m.alias_size_in_bytes, m.temp_size_in_bytes,
                   cost.get("flops"), cost.get("bytes accessed"), compiled.as_text() if keep_hlo else "")


def largest_batch(a: Program, b: Program, hbm: int, step: int) -> int | None:
    """The largest batch (a multiple of `step`) whose peak fits `hbm`, on the line through two programs; None
    where the peak does not grow with the batch (the compiler's schedule, not the rows, sets it)."""
    per_row = (b.peak - a.peak) / (b.batch - a.batch)
    if per_row <= 0:
        return None
    return max(0, int((hbm - (a.peak - per_row * a.batch)) / per_row) // step * step)


def checked_largest(compile_fn, known: list[Program], guess: int | None, hbm: int, step: int,
                    tries: int = 4) -> tuple[int | None, int]:
    """(the largest batch that fits, compiled, or None; the compiles it took): the line's `guess` compiled;
    where it does not fit (the line is not the compiler's, e.g. under remat), the line through the largest
    batch that fits and the smallest that does not guesses again, an eighth of the way between them below that
    one at least (a line that creeps down one row a compile would use every try), up to `tries` compiles. A
    program the compiler builds past the chip's HBM (it does, under remat) does not fit."""
    fits = lambda p: p.fits and p.peak <= hbm  # noqa: E731
    lower, upper = max((p for p in known if fits(p)), key=lambda p: p.batch, default=None), None
    if guess is None or lower is None:
        return guess, 0
    for n in range(tries):
        if guess <= lower.batch or (upper is not None and guess >= upper.batch):
            return lower.batch, n
        tried = program(compile_fn, guess)
        lower, upper = (tried, upper) if fits(tried) else (lower, tried)
        if upper is None:  # the line's guess fits: the line holds
            return lower.batch, n + 1
        below = upper.batch - max((upper.batch - lower.batch) // 8 // step * step, step)
        guess = max(min(largest_batch(lower, upper, hbm, step) or lower.batch, below), lower.batch)
    return lower.batch, tries


def roofline(p: Program, chip: Chip) -> float | None:
    """Seconds of the step at the chip's peak FLOP/s or HBM bandwidth, whichever binds."""
    if p.flops is None:
        return None
    return max(p.flops / chip.bf16_flops, (p.bytes_accessed or 0) / chip.hbm_bandwidth)


@dataclasses.dataclass
class Report:
    topology: str
    chip: Chip
    mesh: dict
    policy: str                 # the remat policy compiled
    train: Program
    largest: int | None         # global batch, compiled; None without a second compile, or where the peak did not grow
    per_chip_rows: int          # the global batch's rows on one chip (the batch axes split it)
    model_flops: float          # the FLOPs formula's (models/flops.py) training FLOPs per step and chip
    decode: Program | None = None


def compile_run(config, name: str, task_name: str, second: bool = True, decode: bool = True,
                keep_hlo: bool = False, slices: int = 1) -> Report:
    """The train step of a resolved, checked `config` (and, with `decode`, a causal LM's decode step) compiled for
    topology `name` (`slices` of them, the mesh's data axis across them: `parallel.over_slices`); `second`: a
    second batch's compile, for the largest batch that fits."""
    devs = devices(name, slices)
    chip = chip_of(devs)
    mesh = parallel.make_mesh(config.mesh, devs)
    parallel.check_mesh(config, mesh)
    rows = np.arange(config.data.batch_size)  # one process compiles for every host: all the rows
    with tempfile.TemporaryDirectory() as workdir:
        task = tasks.build(config, workdir, task_name, rows, 0)
        local = task.train_batch(0)
    tx, _ = optim.make_optimizer(config.optim, config.train.steps,
                                 adapters_only=config.get("lora", {}).get("rank", 0) > 0)
    rules = sharding.rules_of(config.mesh)
    remat = config.model.get("remat", "none")
    built = {}

    def compile_fn(policy):
        def at(batch):
            built[policy] = loop.train_step_for(config, task, tx, mesh, rules, policy)
            abstract = memory.abstract_batch(local, parallel.batch_sharding(mesh), batch)
            return built[policy][3].lower(built[policy][1], abstract, jax.random.key(0)).compile()
        return at

    hbm = int(chip.hbm_gib * GiB)
    for policy in memory.REMAT_ORDER if remat == "auto" else (remat,):
        train = program(compile_fn(policy), config.data.batch_size, keep_hlo)
        if train.fits and train.peak <= hbm:
            break
    step = parallel.batch_divisor(mesh) * config.optim.accum_steps
    largest = None
    other = config.data.batch_size // 2 // step * step or 2 * config.data.batch_size
    if second and other != config.data.batch_size:
        known = [train, program(compile_fn(policy), other)]
        largest, _ = checked_largest(compile_fn(policy), known, largest_batch(*known, hbm, step), hbm, step)
    flops = 3 * forward_flops(config, built[policy][1].params)["per_example"] * config.data.batch_size / mesh.size
    report = Report(name if slices == 1 else f"{slices} x {name}", chip, dict(mesh.shape), policy, train, largest,
                    config.data.batch_size // parallel.batch_divisor(mesh), flops)
    if decode and models.task_of(config.model) in ("lm", "image_lm") and task_name in ("lm", "image_lm", "sft"):
        report.decode = program(lambda b: decode_step(built[policy][0], built[policy][1].params,
                                                      built[policy][2].params, mesh, rules, b),
                                config.data.batch_size, keep_hlo)
    return report


def decode_step(model, params, param_shardings, mesh, rules, batch: int):
    """The engine's compiled decode call (`decoding.decode_slots`: up to its `steps` tokens a call, a while
    loop whose body XLA's cost analysis counts once, so its FLOPs and bytes are one token's) over `batch`
    slots of model.max_len positions laid out as the engine lays them (`parallel.cache_sharding`), the params
    placed as training places them; ring attention (a split sequence, which one token is not) decodes as auto."""
    from transformer.inference import decoding, engine

    if getattr(model, "attention", None) == "ring":
        model = model.clone(attention="auto")
    shaped = lambda shape, dtype, where: jax.ShapeDtypeStruct(shape, dtype, sharding=where)  # noqa: E731
    params = jax.tree.map(lambda p, s: shaped(p.shape, p.dtype, s), params, param_shardings)
    layer = lambda x, i: shaped(x.shape[1:], x.dtype, NamedSharding(mesh, P(*x.sharding.spec[1:])))  # noqa: E731
    model, params = common.decoding_form(model.clone(cache_length=model.max_len), params, layer)  # as the engine
    rows = parallel.batch_sharding(mesh) if batch % parallel.batch_divisor(mesh) == 0 else parallel.replicated(mesh)
    cache = jax.tree.map(lambda x: shaped((batch, *x.shape), x.dtype, None), decoding.cache_shapes(model, 1))
    cache = jax.tree.map(lambda x, at: shaped(x.shape, x.dtype, at), cache, parallel.cache_sharding(mesh, cache))
    state = jax.tree.map(lambda x: shaped(x.shape, x.dtype, rows), engine.slot_rows(batch))
    with sharding.sharding_context(mesh, rules), jax.set_mesh(mesh):  # the mesh keys jit's cache: a new one retraces
        return decoding.decode_slots.lower(model, params, cache, state, engine.STEPS).compile()


def _gib(x) -> str:
    return "-" if x is None else f"{x / GiB:.2f} GiB"


def format_report(r: Report) -> list[str]:
    """The lines `inspect --topology` prints."""
    t, hbm = r.train, r.chip.hbm_gib * GiB
    fits = "fits" if t.fits and t.peak <= hbm else "does NOT fit"
    lines = [f"{r.topology}: {math.prod(r.mesh.values())} x {r.chip.kind} ({r.chip.hbm_gib:g} GiB HBM, "
             f"{r.chip.bf16_flops / 1e12:g} TFLOP/s bf16, {r.chip.hbm_bandwidth / 1e9:,.0f} GB/s), mesh "
             + " ".join(f"{k}={v}" for k, v in r.mesh.items() if v > 1 or k == "data"),
             f"train step (model.remat={r.policy}, batch {t.batch}: {r.per_chip_rows} rows a chip), per chip:",
             f"  arguments {_gib(t.arguments)}, outputs {_gib(t.outputs)}, temporaries {_gib(t.temporaries)}",
             f"  peak {_gib(t.peak)} of {r.chip.hbm_gib:g} GiB: {fits}"]
    if r.largest is not None:
        lines.append(f"  largest batch that fits: {r.largest} ({r.largest * r.per_chip_rows // t.batch} rows a chip; "
                     "guessed from two compiles, memory affine in the batch, and compiled)")
    if t.flops is not None:
        time = roofline(t, r.chip)
        lines.append(f"  compiled: {t.flops:.3e} FLOPs, {t.bytes_accessed or 0:.3e} bytes accessed; roofline "
                     f"{time * 1e3:,.2f} ms a step ({r.model_flops:.3e} FLOPs by the model's formula: "
                     f"{r.model_flops / r.chip.bf16_flops * 1e3:,.2f} ms at peak)")
    if r.decode is not None:
        d = r.decode
        lines.append(f"decode (the engine's call, {d.batch} slots, cache of model.max_len), per chip: "
                     f"peak {_gib(d.peak)}"
                     + (f", roofline {roofline(d, r.chip) * 1e3:,.3f} ms a token" if d.flops is not None else "")
                     + ("" if d.fits and d.peak <= hbm else ": does NOT fit"))
    return lines
