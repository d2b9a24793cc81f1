"""The training loop: one jitted step, periodic logging, eval, checkpoints, clean interruption.

Everything a run writes lives in its workdir (`transformer.rundir` lists it).
Launching again on the same workdir resumes from the latest checkpoint; since the
batch and dropout key of step s depend only on (seed, s), the resumed run computes
exactly what the uninterrupted one would have.
"""

import dataclasses
import math
import os
import signal
import sys
import time

import jax
import numpy as np
from flax import traverse_util

from transformer import checkpoints, console, models, parallel, rundir, sharding
from transformer.interop import hf
from transformer.layers import matmul
from transformer.models import common
from transformer.training import checks, memory, mfu, optim, profiler, steps, tasks
from transformer.training import metrics as metrics_lib
from transformer.training.prefetch import Prefetch
from transformer.training.tasks import classification


class NonFiniteLoss(RuntimeError):
    pass


class Interrupt:
    """Turns SIGINT / SIGTERM into a flag the loop checks after each step.

    A second Ctrl-C (SIGINT) aborts without saving; a repeated SIGTERM does not: schedulers
    and a dying parent (PR_SET_PDEATHSIG) can send it more than once, and the run is saving.
    The processes of a multi-host run agree on stopping at a logging step (`requested`): they
    must save the same step together, whichever of them got the signal.
    """

    def __init__(self):
        self.signal = None
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal and signum == signal.SIGINT:
            raise KeyboardInterrupt("second SIGINT: stopped without saving")
        self.signal = signal.Signals(signum).name

    def requested(self, step: int, log_every: int) -> bool:
        """Whether to save and stop after `step`: at once in a single process, else at the next
        logging step, if any process got a signal (every process calls it)."""
        if jax.process_count() == 1:
            return self.signal is not None
        return step % log_every == 0 and parallel.any_process(self.signal is not None)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def evaluate(run, params) -> dict:
    """The task's eval metrics of `params` over its eval batches (`run`: a Run, or anything with its `task`,
    `eval_step` and `place`, such as `evaluation.Evaluation`), and the model's auxiliary metrics
    (`steps.AUX`), means over the batches; {} without eval batches (config.data.eval_batches=0)."""
    outputs = jax.device_get([run.eval_step(params, run.place(b)) for b in run.task.eval_batches()])
    if not outputs:
        return {}
    aux = [o.pop(steps.AUX) for o in outputs]
    means = {f"eval/{k}": float(np.mean([a[k] for a in aux])) for k in (aux[0] if aux else {})}
    return {**run.task.eval_metrics(outputs), **means}


def init_from(run_dir: str, params, shardings, head=(), new_head: str = "", grow: bool = False):
    """`params` with every weight that the run in `run_dir` also has (same path) taken from it.

    The rest (a new head, say) keeps its fresh initialisation. The weights of a classifier's outputs (`head`)
    start fresh too where `new_head` says why (its labels are not this run's) or their shape differs (another
    number of labels), said in one line; with `grow`, a weight larger along one axis (a vocabulary grown by a
    chat format's markers) takes the saved part, its new rows keeping theirs; any other weight of another
    shape fails. Layer stacks are converted between the scanned and unscanned layouts.
    """
    if not os.path.exists(os.path.join(run_dir, rundir.CHECKPOINTS)):
        raise FileNotFoundError(f"config.init_from={run_dir!r} holds no checkpoints/")
    saved = rundir.RunDir(run_dir).restore_params()
    source = traverse_util.flatten_dict(common.match_layers(saved, params), sep="/")
    target, placements = (traverse_util.flatten_dict(t, sep="/") for t in (params, shardings))
    differ = [name for name, value in target.items() if name in source and source[name].shape != value.shape]
    fresh = [name for name in head if name in source and (new_head or name in differ)]
    for name in set(differ) - set(fresh):
        source[name] = _grown(name, source[name], target[name], run_dir, grow)
    loaded = {name: jax.device_put(np.asarray(source[name]), placements[name])  # numpy: placeable on any host
              for name in target if name in source and name not in fresh}
    if jax.process_index() == 0:
        if fresh:
            why = new_head or ", ".join(f"{n} is {source[n].shape} there, {target[n].shape} here" for n in fresh)
            print(f"init_from {run_dir}: a new head ({', '.join(fresh)} start fresh): {why}", file=sys.stderr)
        print(f"init_from {run_dir}: {len(loaded)} of {len(target)} weights loaded; new: "
              f"{', '.join(sorted(set(target) - set(loaded))) or 'none'}", file=sys.stderr)
    return traverse_util.unflatten_dict({**target, **loaded}, sep="/")


def _grown(name: str, saved, fresh, run_dir: str, grow: bool) -> np.ndarray:
    """`fresh` with `saved` in its leading part, where they differ along one axis only, `fresh`'s longer."""
    differ = [a for a, (s, f) in enumerate(zip(saved.shape, fresh.shape)) if s != f]
    if not grow or saved.ndim != fresh.ndim or len(differ) != 1 or saved.shape[differ[0]] > fresh.shape[differ[0]]:
        raise ValueError(f"config.init_from: {name} is {saved.shape} in {run_dir} but {fresh.shape} here")
    out = np.array(fresh)
    out[tuple(slice(0, n) for n in saved.shape)] = np.asarray(saved)
    return out


@dataclasses.dataclass
class Run:
    """What the step loop needs, built once by `setup`."""

    config: object
    workdir: str
    model: object
    mesh: object
    task: object
    schedule: object
    state: object
    train_step: object     # jitted (to lower or inspect); the loop runs `compiled_step`
    compiled_step: object
    compile_seconds: float
    eval_step: object
    ckpt: checkpoints.Checkpointer
    writer: metrics_lib.MetricWriter
    step_rng: object
    is_main: bool
    rows: np.ndarray       # the rows of each global batch that this process builds
    utilisation: mfu.Utilisation  # train/mfu: model FLOPs of a global batch over the mesh's peak

    @property
    def throughput_key(self) -> str:
        return f"train/{self.task.item_name}_per_s"

    def place(self, local_batch: dict) -> dict:
        """This process's rows of a batch -> the global batch on the mesh."""
        return parallel.global_batch(local_batch, self.mesh, self.rows, self.config.data.batch_size)


def setup(config: checks.Checked, workdir: str, devices=None) -> Run:
    """Builds (or restores) everything of the run in `workdir` from its config as the command resolved and
    validated it, once (`checks.checked`); a step that cannot fit in the device's memory fails before any
    state is made (`memory`)."""
    if not isinstance(config, checks.Checked):
        raise TypeError("loop.setup takes checks.checked(config): the config resolved and validated once")
    said, task_name, config = config.said, config.task, config.config
    mesh, rows = prepare(config, devices)
    if jax.process_index() == 0:
        for line in [*said, hf.export_line(config.model)]:
            print(line, file=sys.stderr)
    run_dir = rundir.RunDir(workdir)
    ckpt = run_dir.checkpointer(config.train.keep_checkpoints, config.train.checkpoint_every)
    with parallel.main_process_first("preparing the workdir and the data"):
        run_dir.check_model(config)
        run_dir.forget_failed_launch(config)
        task = tasks.build(config, workdir, task_name, rows, ckpt.latest_step() or 0)
    adapters_only = config.get("lora", {}).get("rank", 0) > 0
    tx, schedule = optim.make_optimizer(config.optim, config.train.steps, adapters_only=adapters_only)
    rng = jax.random.key(config.train.seed)
    rules = sharding.rules_of(config.mesh)
    is_main = jax.process_index() == 0
    step = _fitting_step(config, task, tx, mesh, rules, ckpt.latest_step() or 0, jax.random.fold_in(rng, 1), is_main)
    model, shardings = step.model, step.shardings
    if ckpt.latest_step() is not None:  # restored onto the shapes alone: no second copy of the state
        state, skipped = ckpt.newest_whole(lambda s: ckpt.restore(step.state, shardings, s), lambda s: s.params)
        ckpt.set_aside(skipped)
    else:
        state, _ = steps.create_train_state(model, tx, mesh, rules, jax.random.fold_in(rng, 0), task.init_inputs(),
                                            shardings)
        if config.init_from:
            head = classification.head_weights(config.model), getattr(task, "new_head", "")
            state = state.replace(params=init_from(config.init_from, state.params, shardings.params, *head,
                                                   grow=task_name == "sft"))
    eval_step = make_eval_step(task, model, mesh, rules, shardings.params, common.auxiliary(config))
    run_dir.write_config(config)  # once the launch holds up: a failed one leaves a run's config.json as it was
    writer = metrics_lib.MetricWriter(workdir, enabled=is_main, resume_step=int(state.step))
    flops_per_step, peak, described = mfu.model_flops(config, mesh, step.state.params)
    if is_main:
        print(f"train/mfu: {flops_per_step:,.0f} model FLOPs per step (transformer.inspect) against {mesh.size} x "
              f"{described}", file=sys.stderr)
        dtype = config.model.get("dtype", "float32")
        if mesh.devices.flat[0].platform == "cpu" and dtype == "bfloat16" and matmul.cpu_lacks_bf16():
            print(f"config.model.dtype={dtype}: this CPU has no bfloat16 instructions (avx512_bf16, amx_bf16), so "
                  "XLA computes in float32 plus conversions: expect a slower step than with float32", file=sys.stderr)
    return Run(config, workdir, model, mesh, task, schedule, state, step.jitted, step.compiled, step.seconds, eval_step,
               ckpt, writer, jax.random.fold_in(rng, 1), is_main, rows, mfu.Utilisation(flops_per_step, peak))


def prepare(config, devices=None) -> tuple[object, np.ndarray]:
    """What a run and an evaluation of a checked config both start from: the mesh and the rows of each global
    batch that this process builds; a bad mesh, or a batch that cannot fit its memory, fails before any data is
    read."""
    mesh = parallel.make_mesh(config.mesh, devices)
    parallel.check_mesh(config, mesh)
    rows = parallel.process_rows(mesh, config.data.batch_size)
    use_compile_cache(mesh.devices.flat[0].platform)
    memory.check_batch(config, mesh)
    return mesh, rows


def make_eval_step(task, model, mesh, rules, param_shardings, aux=common.NO_AUXILIARY):
    """The jitted eval step: (params placed by `param_shardings`, a global batch) -> the task's eval outputs
    and the auxiliary metrics of `aux`, replicated."""
    return jax.jit(steps.make_eval_step(task, model, mesh, rules, aux), in_shardings=(
        param_shardings, parallel.batch_sharding(mesh)), out_shardings=parallel.replicated(mesh))


def use_compile_cache(platform: str) -> None:
    """Keeps the programs that XLA compiles for a GPU or TPU in `console.user_cache('xla')`: a relaunched,
    resumed or swept run then loads a step compiled before (gpt2-small's takes ~20 s on an H100) instead
    of compiling it again (the bench turns the cache off: it times compiles). Left alone where
    JAX_COMPILATION_CACHE_DIR (or jax.config) names a cache, and on CPUs, whose cache keys do not name
    the instruction set (a home shared by unlike hosts). Effective only before the process's first
    compile; JAX_ENABLE_COMPILATION_CACHE=false turns any cache off."""
    if platform != "cpu" and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", console.user_cache("xla"))


@dataclasses.dataclass
class FittingStep:
    """The train step of the remat policy that fits (`memory.fitting`), compiled, with its model."""

    model: object
    state: object          # the train state's shapes
    shardings: object      # and placements
    jitted: object
    compiled: object
    seconds: float         # compiling it (and any policy tried before it)


def _fitting_step(config, task, tx, mesh, rules, start: int, step_rng, is_main: bool) -> FittingStep:
    """Compiles the train step from shapes alone (nothing allocated) for the first remat policy whose
    memory fits the device; says which, and what it takes."""
    batch = memory.abstract_batch(task.train_batch(start), parallel.batch_sharding(mesh), config.data.batch_size)
    remat = config.model.get("remat", "none")  # a family without the setting recomputes nothing
    built = {}

    def compile_step(policy: str):
        built[policy] = train_step_for(config, task, tx, mesh, rules, policy)
        return built[policy][-1].lower(built[policy][1], batch, step_rng).compile()

    start_time = time.perf_counter()
    limit = memory.available(config.train.memory_limit_gb, mesh.devices.flat[0])
    policy, compiled, size = memory.fitting(compile_step, remat, limit, config.optim.accum_steps)
    if is_main:
        print(memory.describe(policy, remat, size, limit), file=sys.stderr)
        print(memory.trainable(built[policy][1]), file=sys.stderr)
    return FittingStep(*built[policy], compiled, time.perf_counter() - start_time)


def train_step_for(config, task, tx, mesh, rules, policy: str) -> tuple:
    """(model, state shapes, shardings, jitted train step) of `config` under remat `policy` on `mesh`: what a
    launch compiles (`_fitting_step`) and what `training/topology.py` compiles for a TPU slice."""
    model = models.build({**config.model.to_dict(), **({"remat": policy} if "remat" in config.model else {})},
                         config.get("lora"))
    state, shardings = steps.abstract_train_state(model, tx, mesh, rules, task.init_inputs())
    train_step = steps.make_train_step(task, model, mesh, rules, config.optim.accum_steps, common.auxiliary(config))
    jitted = jax.jit(train_step, donate_argnums=0, in_shardings=(shardings, parallel.batch_sharding(mesh), None),
                     out_shardings=(shardings, parallel.replicated(mesh)))
    return model, state, shardings, jitted


def train(config, workdir: str, devices=None) -> dict:
    """Trains (or resumes) the run in `workdir` on `devices` (default: all) from a `checks.Checked` config
    (or a config, checked here), holding it (`rundir.hold`); returns the last metrics."""
    launch = config if isinstance(config, checks.Checked) else checks.checked(config, workdir=workdir)
    lock = rundir.hold(workdir) if jax.process_index() == 0 else None
    try:
        return _train(launch, workdir, devices)
    finally:
        if lock is not None:
            lock.close()


def _train(launch: checks.Checked, workdir: str, devices=None) -> dict:
    run = setup(launch, workdir, devices)
    config = run.config
    if run.is_main:
        n_params = sum(x.size for x in jax.tree.leaves(run.state.params))
        print(f"{config.model.family} {n_params:,} params | mesh {dict(run.mesh.shape)} | "
              f"steps {int(run.state.step)}->{config.train.steps} | workdir {workdir}", file=sys.stderr)
    bar = console.progress(total=config.train.steps, initial=int(run.state.step), disable=not run.is_main,
                       dynamic_ncols=True, desc="train", every=0)
    harness = None
    if config.train.harness_tasks:  # scored during training; lm-eval (an optional extra) imported only then
        from transformer.inference.harness import DuringTraining  # its tasks and data checked before any step
        harness = DuringTraining(config, workdir, run.model, run.mesh, run.state.params)
    try:
        with Interrupt() as interrupt:
            return _loop(run, bar, interrupt, harness)
    finally:
        bar.close()
        run.ckpt.wait()
        run.ckpt.close()
        run.writer.close()


def _loop(run: Run, bar, interrupt: Interrupt, harness=None) -> dict:
    c = run.config.train
    end = min(c.stop_at or c.steps, c.steps)
    on_policy = isinstance(run.task, tasks.OnPolicy)  # its batch waits for the step's params: none made ahead
    batches = Prefetch(lambda step: run.place(run.task.train_batch(step)), end, ahead=0 if on_policy else 2)
    try:
        return _steps(run, bar, interrupt, batches, end, harness)
    finally:
        batches.close()


def _steps(run: Run, bar, interrupt: Interrupt, batches: Prefetch, end: int, harness=None) -> dict:
    c, state = run.config.train, run.state
    last, pending, t0 = {}, [], time.perf_counter()
    window = profiler.Window(os.path.join(run.workdir, "profile"), c.profile_start, c.profile_steps, bar.write)
    try:
        for step in range(int(state.step), end):
            if isinstance(run.task, tasks.OnPolicy):
                run.task.roll_out(run.model, state.params, step)
            with window.step(step, lambda: state):  # noqa: B023 (read late on purpose: the step's new state)
                state, metrics = run.compiled_step(state, batches.get(step), run.step_rng)
            pending.append(metrics)
            run.ckpt.check()  # a background save that failed stops the run here
            done = step + 1
            bar.update(1)
            stop = interrupt.requested(done, c.log_every)
            if done % c.log_every == 0 or done % c.eval_every == 0 or done == end or stop:
                last, t0 = _log(run, done, pending, t0, bar)
                bar.set_postfix(loss=f"{last['train/loss']:.3f}", per_s=f"{last[run.throughput_key]:.0f}",
                                mfu=f"{last['train/mfu']:.1%}")
                pending = []
            if done % c.checkpoint_every == 0 or done == end or stop:  # before eval: a failing eval costs no steps
                _check_finite(metrics, done, run.ckpt.latest_step())
                run.ckpt.save(state, force=True)
            if done % c.eval_every == 0 or done == end:
                last.update(_eval(run, state.params, done, bar))
                t0 = time.perf_counter()
            if harness is not None and harness.due(done, end):
                scores = harness(state.params)
                run.writer.write(done, scores)
                bar.write(f"step {done}: " + ", ".join(f"{k} {v:.4g}" for k, v in scores.items()))
                last.update(scores)
                t0 = time.perf_counter()
            if stop:
                bar.write(f"{interrupt.signal or 'another process got a signal'}: saved a checkpoint at step "
                          f"{done}; run the same command to resume")
                break
    finally:
        window.close()
    return last


def _eval(run: Run, params, step: int, bar) -> dict:
    """Eval metrics (written, and printed under the bar with the task's report by process 0).

    Every process makes the report: it may run sharded computations that need them all.
    """
    ev = evaluate(run, params)
    if not ev:
        return {}
    run.writer.write(step, ev)
    report = run.task.report(run.model, params, step)
    if run.is_main:
        bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in ev.items()))
        for line in report:
            bar.write(line)
    return ev


def _log(run: Run, step: int, pending: list[dict], since: float, bar):
    """Fetches the metrics of the last steps (one transfer), checks them, writes their means (`over_steps`).

    Returns the means and the time of the fetch (the steps are done by then).
    """
    fetched = jax.device_get(pending)
    now = time.perf_counter()
    means, histograms = metrics_lib.over_steps(fetched)  # histograms: the 2-D metrics (a router's loads)
    if not all(math.isfinite(v) for v in means.values()):
        bad = [k for k, v in means.items() if not math.isfinite(v)]
        raise NonFiniteLoss(f"non-finite {', '.join(bad)} by step {step}; stopped without saving, the "
                            "last good checkpoint is intact (lower config.optim.lr or check the data)")
    means["train/lr"] = float(run.schedule(step - 1))
    seconds = max(now - since, 1e-9)
    means[run.throughput_key] = run.task.items_per_step * len(fetched) / seconds
    means["train/mfu"], raised = run.utilisation(len(fetched), seconds)
    if "train/rollout_seconds" in means:  # an on-policy task's sampling, timed apart from the updates
        means["train/rollout_share"] = means["train/rollout_seconds"] * len(fetched) / seconds
        means["train/update_seconds"] = seconds / len(fetched) - means["train/rollout_seconds"]
    if raised and run.is_main:
        bar.write(raised)
    run.writer.write(step, means, histograms)
    return means, now


def _check_finite(metrics: dict, step: int, saved: int | None) -> None:
    """Stops before a checkpoint of non-finite parameters (the step's new param_norm) or loss is written."""
    bad = [k for k in ("loss", "param_norm") if k in metrics and not math.isfinite(float(metrics[k]))]
    if bad:
        last = f"the last checkpoint, step {saved}, is finite" if saved is not None else "no checkpoint was written"
        raise NonFiniteLoss(f"non-finite {' and '.join(bad)} at step {step}; stopped without saving: {last}, and "
                            "a relaunch resumes from it: lower config.optim.lr or check the data")
