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

from transformer import checkpoints, console, models, parallel, rundir, sharding
from transformer.interop import hf
from transformer.layers import matmul, parametrization
from transformer.models import common
from transformer.training import checks, divergence, memory, mfu, optim, profiler, steps, tasks, trackers, warm_start
from transformer.training import metrics as metrics_lib
from transformer.training.prefetch import Prefetch
from transformer.training.tasks import classification


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

    def postfix(self, last: dict) -> dict[str, str]:
        """The progress bar's loss, throughput (named by its unit: tokens_per_s, pairs_per_s, ...) and MFU."""
        return {"loss": f"{last['train/loss']:.3f}", f"{self.task.item_name}_per_s": f"{last[self.throughput_key]:.0f}",
                "mfu": f"{last['train/mfu']:.1%}"}

    def place(self, local_batch: dict) -> dict:
        """This process's rows of a batch -> the global batch on the mesh."""
        return parallel.global_batch(local_batch, self.mesh, self.rows, self.config.data.batch_size)


def setup(config: checks.Checked, workdir: str, devices=None, resume_step: int | None = None) -> Run:
    """Builds (or restores) everything of the run in `workdir` from its config as the command resolved and
    validated it, once (`checks.checked`); a step that cannot fit in the device's memory fails before any
    state is made (`memory`). `resume_step`: a kept checkpoint to resume from, the later ones set aside."""
    if not isinstance(config, checks.Checked):
        raise TypeError("loop.setup takes checks.checked(config): the config resolved and validated once")
    said, task_name, config = config.said, config.task, config.config
    mesh, rows = prepare(config, devices)
    if jax.process_index() == 0:
        for line in [*said, hf.export_line(config.model)]:
            print(line, file=sys.stderr)
    run_dir = rundir.RunDir(workdir)
    if config.init_from and os.path.exists(os.path.join(config.init_from, rundir.CONFIG)):
        parametrization.check_same(rundir.RunDir(config.init_from).config.model, config.model,
                                   f"config.init_from={config.init_from}")
    ckpt = run_dir.checkpointer(config.train.keep_checkpoints, config.train.checkpoint_every)
    with parallel.main_process_first("preparing the workdir and the data"):
        run_dir.check_model(config)
        if resume_step is not None:
            ckpt.rewind(resume_step)
        run_dir.forget_failed_launch(config)
        task = tasks.build(config, workdir, task_name, rows, ckpt.latest_step() or 0)
    adapters_only = config.get("lora", {}).get("rank", 0) > 0
    tx, schedule = optim.make_optimizer(config.optim, config.train.steps, adapters_only=adapters_only,
                                        width_mult=parametrization.optimizer_width_mult(config.model))
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
            state = state.replace(params=warm_start.init_from(config.init_from, state.params, shardings.params,
                                                              *head, grow=task_name == "sft"))
    eval_step = make_eval_step(task, model, mesh, rules, shardings.params, common.auxiliary(config))
    run_dir.write_config(config)  # once the launch holds up: a failed one leaves a run's config.json as it was
    say = lambda line: print(line, file=sys.stderr)  # noqa: E731
    writer = metrics_lib.MetricWriter(workdir, enabled=is_main, resume_step=int(state.step), say=say, trackers=(
        trackers.start(config, workdir, resumed=int(state.step) > 0, say=say) if is_main else ()))
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
    memory.check_batch(config, mesh)  # before the rows: a batch of 10^8 rows is seconds of numpy alone
    rows = parallel.process_rows(mesh, config.data.batch_size)
    use_compile_cache(mesh.devices.flat[0].platform)
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


def train(config, workdir: str, devices=None, resume_step: int | None = None) -> dict:
    """Trains (or resumes) the run in `workdir` on `devices` (default: all) from a `checks.Checked` config
    (or a config, checked here), holding it (`rundir.hold`); returns the last metrics. `resume_step`: resume
    from that kept checkpoint rather than the latest (`setup`)."""
    launch = config if isinstance(config, checks.Checked) else checks.checked(config, workdir=workdir)
    lock = rundir.hold(workdir) if jax.process_index() == 0 else None
    try:
        return _train(launch, workdir, devices, resume_step)
    finally:
        if lock is not None:
            lock.close()


def _train(launch: checks.Checked, workdir: str, devices=None, resume_step: int | None = None) -> dict:
    run = setup(launch, workdir, devices, resume_step)
    config = run.config
    if run.is_main:
        n_params = sum(x.size for x in jax.tree.leaves(run.state.params))
        print(f"{config.model.family} {n_params:,} params | mesh {dict(run.mesh.shape)} | "
              f"steps {int(run.state.step)}->{config.train.steps} | workdir {workdir}", file=sys.stderr)
    bar = console.progress(total=config.train.steps, initial=int(run.state.step), disable=not run.is_main,
                       dynamic_ncols=True, desc="train", every=0)
    harness = None
    if config.train.harness_tasks:  # scored during training; lm-eval (an optional extra) imported only then
        from transformer.training.harness_tasks import DuringTraining  # its tasks and data checked before any step
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
        if isinstance(run.task, tasks.OnPolicy) and int(state.step) == 0:
            last.update(_eval(run, state.params, 0, bar))  # the baseline its held-out reward is read against
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
                bar.set_postfix(**run.postfix(last))
                pending = []
            if done % c.checkpoint_every == 0 or done == end or stop:  # before eval: a failing eval costs no steps
                divergence.check_finite(metrics, done, run.workdir, run.ckpt.manager.all_steps())
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
    if isinstance(run.task, tasks.OnPolicy):
        ev.update(run.task.eval_rollouts(run.model, params, step))
    if not ev:
        return {}
    run.writer.write(step, ev)
    report = run.task.report(run.model, params, step)
    run.writer.figures(step, os.path.join(run.workdir, "samples"))
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
        divergence.stop(f"non-finite {', '.join(bad)} by step {step}", run.workdir, run.ckpt.manager.all_steps())
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
