"""The profiler window the training loop opens, and the reader of what it traced: device time per kernel
per step.

  window = Window(WORKDIR/profile, start, steps)      # the loop: `with window.step(s, state_of): ...`
  lines = report(latest_trace(WORKDIR), top=30)       # `python -m transformer.profile WORKDIR`

`train.profile_steps` N > 0 traces steps S .. S + N - 1 (S = `train.profile_start`, after the first
steps' compilation and autotuning) into WORKDIR/profile with `jax.profiler`: TensorBoard's profile
plugin and XProf open that folder (`tensorboard --logdir WORKDIR/profile`), ui.perfetto.dev its
`perfetto_trace.json.gz`. Each traced step is a `StepTraceAnnotation("train", step_num=s)` and ends
when its state is ready, so a kernel belongs to the step whose window it starts in.

The table: each kernel's device time per step (the mean over the steady steps: the first `skip`
traced steps dropped), its share of the step's busy time and its launches per step. On a GPU the
kernels are the events of the device planes' streams, named by XLA's op (`hlo_op`) where it named
them; on a CPU they are XLA's thunks, which run on several threads at once, so their sum exceeds the
step's wall time. Note: XLA turns CUDA graphs off while profiling unless XLA_FLAGS has
--xla_enable_command_buffers_during_profiling=true (a traced step then launches each kernel alone).
"""

import collections
import contextlib
import glob
import os
import warnings

import jax


class Window:
    """The steps [start, start + steps) of a run traced into `directory` (nothing where steps = 0)."""

    def __init__(self, directory: str, start: int, steps: int, say=print):
        self.directory, self.start, self.end, self.say = directory, start, start + steps, say
        self.tracing = False

    @contextlib.contextmanager
    def step(self, step: int, state_of: callable):
        """Around the loop's step `step`; `state_of()` is the state to wait for (the step's output)."""
        if step == self.start and step < self.end:
            jax.block_until_ready(state_of())  # the earlier steps stay out of the window
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.tracing = True
        if not self.tracing:
            yield
            return
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            yield
            jax.block_until_ready(state_of())
        if step + 1 == self.end:
            self.close()

    def close(self) -> None:
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()
            self.say(f"profile: steps {self.start}..{self.end - 1} traced into {self.directory} "
                     f"(python -m transformer.profile {os.path.dirname(self.directory)})")


def latest_trace(workdir: str) -> str:
    """The newest xplane.pb of WORKDIR/profile (or of WORKDIR itself, a profile folder)."""
    found = [p for base in (os.path.join(workdir, "profile"), workdir)
             for p in glob.glob(os.path.join(base, "plugins", "profile", "*", "*.xplane.pb"))]
    if not found:
        raise FileNotFoundError(f"no trace under {workdir}/profile: train with --config.train.profile_steps=N")
    return max(found, key=os.path.getmtime)


def stats_of(event) -> dict:
    """An event's stats. jaxlib makes their iterator's type on first use without a `__module__`, which Python
    3.12+ warns of (a DeprecationWarning that is jaxlib's, not a use of anything deprecated)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "builtin type event_stats has no __module__", DeprecationWarning)
        return dict(event.stats)


def step_windows(data) -> list[tuple[int, int, int]]:
    """(step, start ns, end ns) of each traced train step, in order."""
    windows = []
    for plane in data.planes:
        if plane.name.startswith("/host:"):
            for line in plane.lines:
                windows += [(int(stats_of(e)["step_num"]), e.start_ns, e.end_ns)
                            for e in line.events if e.name == "train" and "step_num" in stats_of(e)]
    return sorted(windows)


def kernels(data):
    """(name, start ns, duration ns) of what the devices ran: GPU/TPU planes' stream events, else the CPU's
    XLA thunks (events with an `hlo_op` stat)."""
    devices = [p for p in data.planes if p.name.startswith(("/device:GPU", "/device:TPU"))]
    for plane in devices or [p for p in data.planes if p.name == "/host:CPU"]:
        for line in plane.lines:
            if devices and (line.name.startswith("CUPTI") or "overhead" in line.name.lower()):
                continue
            for event in line.events:
                stats = stats_of(event)
                if devices or "hlo_op" in stats:
                    yield str(stats.get("hlo_op", event.name)), event.start_ns, event.duration_ns


def table(data, skip: int = 1) -> tuple[dict, list[int]]:
    """({kernel: [ns in each steady step]}, the steady steps): kernels attributed to the step whose window
    they start in; the first `skip` traced steps dropped (kept where that leaves none)."""
    windows = step_windows(data)
    if not windows:
        raise ValueError("the trace holds no train steps (StepTraceAnnotation 'train')")
    steady = windows[skip:] or windows
    per_kernel = collections.defaultdict(lambda: [0] * len(steady))
    calls = collections.Counter()
    for name, start, duration in kernels(data):
        for i, (_, begin, end) in enumerate(steady):
            if begin <= start < end:
                per_kernel[name][i] += duration
                calls[name] += 1
                break
    return {k: (v, calls[k] / len(steady)) for k, v in per_kernel.items()}, [s for s, _, _ in steady]


def report(path: str, top: int = 30, skip: int = 1) -> list[str]:
    """The table's lines."""
    data = jax.profiler.ProfileData.from_file(path)
    rows, steps = table(data, skip)
    busy = sum(sum(times) for times, _ in rows.values()) / len(steps)
    lines = [f"{path}: steps {steps[0]}..{steps[-1]} (steady), device busy {busy / 1e6:.2f} ms a step",
             f"{'ms/step':>9} {'share':>6} {'calls':>6}  kernel"]
    ordered = sorted(rows.items(), key=lambda kv: -sum(kv[1][0]))
    for name, (times, calls) in ordered[:top]:
        mean = sum(times) / len(times)
        lines.append(f"{mean / 1e6:9.3f} {mean / busy:6.1%} {calls:6.1f}  {name[:120]}")
    rest = ordered[top:]
    if rest:
        mean = sum(sum(t) for t, _ in (r for _, r in rest)) / len(steps)
        lines.append(f"{mean / 1e6:9.3f} {mean / busy:6.1%} {'':>6}  ({len(rest)} more kernels)")
    return lines
