"""Per-device memory of the compiled GPT train step as FSDP grows (nothing is allocated).

    python experiments/scaling/fsdp_memory.py                       # gpt2-medium, fsdp 1 and 8
    python experiments/scaling/fsdp_memory.py --fsdp 1,2,4,8 --set model.scan_layers=True --set model.remat=full

For each FSDP size the 8 devices form the mesh (data = 8 / fsdp, fsdp, tensor = 1); the
train step of `transformer.training.steps` is jitted with the state's logical shardings,
lowered on abstract shapes and compiled. Printed per device, in GiB: the train state
(params + optimizer state, from each leaf's shard shape), XLA's compiled memory analysis
of the per-device SPMD program and the seconds to lower and compile it. Without 8
accelerators it runs on 8 fake CPU devices. The vocabulary is GPT-2's (`data.tokenizer=gpt2`,
50,257 ids; `--set data.tokenizer=...` another).
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import math
import time

import jax
import jax.numpy as jnp

from transformer import cli, models, parallel, sharding
from transformer import config as config_lib
from transformer.training import optim, shapes, steps
from transformer.training.tasks import lm

DEVICES = 8
GIB = 2**30
COLUMNS = ("state", "argument", "output", "alias", "temp", "code", "peak")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/gpt.py:gpt2-medium")
    p.add_argument("--fsdp", default="1,8", help="comma-separated FSDP sizes, each dividing 8")
    p.add_argument("--seq_len", type=int)
    p.add_argument("--batch_size", type=int, help="global batch (a multiple of 8)")
    p.add_argument("--num_layers", type=int)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config override")
    return p.parse_args()


def load_config(args: argparse.Namespace):
    shortcuts = {"data.seq_len": args.seq_len, "data.batch_size": args.batch_size,
                 "model.num_layers": args.num_layers}
    overrides = ["data.tokenizer=gpt2"] + [f"{k}={v}" for k, v in shortcuts.items() if v is not None] + args.set
    try:
        config = shapes.resolved(config_lib.load(args.config, overrides))
    except cli.CONFIG_ERRORS as e:
        raise SystemExit(f"error in --config/--set: {e}") from None
    if models.task_of(config.model) != "lm":
        raise SystemExit(f"{args.config}: its task is {models.task_of(config.model)!r}; this benchmark takes an "
                         "'lm' config")
    return config


def bench_devices() -> list:
    """The first 8 default devices, or 8 (fake) CPU devices where there are fewer."""
    devices = jax.devices()
    return devices[:DEVICES] if len(devices) >= DEVICES else jax.devices("cpu")[:DEVICES]


def abstract_state(config, model, mesh):
    """The train state's shapes and shardings, as `steps.create_train_state` builds them."""
    tx, _ = optim.make_optimizer(config.optim, config.train.steps)
    inputs = models.family(config.model.family).example_inputs(model)
    return steps.abstract_train_state(model, tx, mesh, sharding.rules_of(config.mesh), inputs)


def state_bytes(state, shardings) -> int:
    """Bytes of one device's shards of the state."""
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)))


def lm_task(config) -> lm.LMTask:
    """An LMTask without its data: the train step calls only its `loss` and `loss_weights`, which read
    its config."""
    task = object.__new__(lm.LMTask)
    task.config = config
    return task


def compile_step(config, model, mesh, state, shardings):
    batch_sharding = parallel.batch_sharding(mesh)
    train_step = steps.make_train_step(lm_task(config), model, mesh, sharding.rules_of(config.mesh),
                                       config.optim.accum_steps)
    step = jax.jit(train_step, donate_argnums=0,
                   in_shardings=(shardings, batch_sharding, None),
                   out_shardings=(shardings, parallel.replicated(mesh)))
    batch = {"tokens": jax.ShapeDtypeStruct((config.data.batch_size, config.data.seq_len + 1), jnp.int32)}
    return step.lower(state, batch, jax.random.key(0)).compile()


def measure(config, model, fsdp: int, devices: list) -> dict:
    """Per-device bytes of the state and of the compiled step, and the compile time."""
    config.mesh.update(data=DEVICES // fsdp, fsdp=fsdp, tensor=1)
    mesh = parallel.make_mesh(config.mesh, devices)
    parallel.check_mesh(config, mesh)
    state, shardings = abstract_state(config, model, mesh)
    start = time.perf_counter()
    m = compile_step(config, model, mesh, state, shardings).memory_analysis()
    seconds = time.perf_counter() - start
    sizes = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes, alias=m.alias_size_in_bytes,
                 temp=m.temp_size_in_bytes, code=m.generated_code_size_in_bytes)
    peak = sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"]
    return dict(state=state_bytes(state, shardings), **sizes, peak=peak, seconds=seconds)


def format_table(results: dict[int, dict]) -> list[str]:
    lines = [f"{'fsdp':>6} " + " ".join(f"{c:>9}" for c in COLUMNS) + f" {'compile s':>10}"]
    for fsdp, r in results.items():
        lines.append(f"{fsdp:>6} " + " ".join(f"{r[c] / GIB:>9.3f}" for c in COLUMNS) + f" {r['seconds']:>10.1f}")
    if len(results) < 2:
        return lines
    first, last = results[min(results)], results[max(results)]
    lines.append(f"{f'{min(results)}/{max(results)}':>6} "
                 + " ".join(f"{first[c] / last[c]:>8.2f}x" if last[c] else f"{'-':>9}" for c in COLUMNS))
    return lines


def main() -> None:
    args = parse_args()
    config = load_config(args)
    model = models.build(config.model)
    devices = bench_devices()
    n_params = models.count_params(config.model)
    print(f"{args.config}: {n_params:,} params, {config.model.num_layers} layers, batch "
          f"{config.data.batch_size} x {config.data.seq_len} tokens, {len(devices)} x {devices[0].platform} "
          f"devices, jax {jax.__version__}", flush=True)
    results = {}
    for fsdp in (int(f) for f in args.fsdp.split(",")):
        print(f"compiling fsdp={fsdp} (mesh data={DEVICES // fsdp}, fsdp={fsdp}, tensor=1) ...", flush=True)
        results[fsdp] = measure(config, model, fsdp, devices)
    print("\nper device, GiB (peak = argument + output - alias + temp):")
    print("\n".join(format_table(results)))


if __name__ == "__main__":
    main()
