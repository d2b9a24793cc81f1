"""Running a sweep's trials (`run_trials`), as local processes or Ray tasks on a cluster.

A launcher starts a trial's command in its folder DIR (output appended to DIR/trial.log) and
returns a handle with `poll()` (the exit code, or None while it runs), `terminate()` and
`wait()`, as `subprocess.Popen` has. Each trial is its own `python -m transformer.train`
process either way, so it owns its devices: one GPU per trial where there are GPUs. The
process holds a lock on DIR/.lock (fcntl.flock) until it exits, on whichever host runs it,
so a trial is never started twice at once: a sweep rerun after a killed one waits for the
old process to save its checkpoint and exit.

  local   processes on this machine; slot i of --parallel gets the i-th visible GPU (this
          process's CUDA_VISIBLE_DEVICES list where set, else every GPU nvidia-smi lists),
          and --parallel is capped at the number of GPUs
  ray     Ray tasks (`ray.init(address)`; a local Ray instance when no address is given),
          one GPU each on a cluster with GPUs, else one CPU; paths are made absolute and the
          trial runs in the sweep's working directory, which every node must see (a shared
          filesystem), as must the workdir
"""

import dataclasses
import fcntl
import itertools
import json
import os
import signal
import subprocess
import sys
import time

from tqdm import tqdm

from transformer import cli, console
from transformer.sweep import results

LOCK = ".lock"


def lock_trial(trial_dir: str, blocking: bool = True) -> int | None:
    """Opens and locks DIR/.lock, waiting while another process holds it; its descriptor, or
    None when another process holds it and not `blocking`."""
    fd = os.open(os.path.join(trial_dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def start_process(command: list[str], trial_dir: str, env: dict, cwd: str | None = None) -> subprocess.Popen:
    """The trial's process, holding DIR/.lock for its lifetime (the lock passes to it: flock
    belongs to the open file, which the child shares and this process closes)."""
    lock = lock_trial(trial_dir)
    try:
        with open(os.path.join(trial_dir, "trial.log"), "a") as log:
            return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, pass_fds=(lock,),
                                    env={**env, cli.PARENT: str(os.getpid())})
    finally:
        os.close(lock)


def visible_gpus(environ=os.environ) -> list[str]:
    """The GPUs this process may give its trials, as CUDA_VISIBLE_DEVICES names them: its own
    list where that is set (up to an invalid entry such as -1, as CUDA reads it), else every
    NVIDIA GPU nvidia-smi lists (found without importing jax, which would claim them)."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        names = [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",")]
        return list(itertools.takewhile(lambda d: d and not d.startswith("-"), names))
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i in range(sum(1 for line in out.splitlines() if line.startswith("GPU ")))]


class Local:
    """Trials as processes on this machine, one GPU each where there are GPUs."""

    def __init__(self, gpus: list[str] | None = None):
        self.gpus = visible_gpus() if gpus is None else gpus

    def slots(self, parallel: int) -> int:
        """How many trials run at once: `parallel`, at most one per GPU."""
        if self.gpus and parallel > len(self.gpus):
            print(f"warning: --parallel={parallel} but {len(self.gpus)} GPUs: running {len(self.gpus)} trials "
                  "at a time, one GPU each", file=sys.stderr)
            return len(self.gpus)
        return parallel

    def env(self, slot: int) -> dict:
        """The environment of the trial in `slot`: the slot's GPU alone visible."""
        env = dict(os.environ)
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[slot % len(self.gpus)]
        return env

    def start(self, command: list[str], trial_dir: str, slot: int):
        return start_process(command, trial_dir, self.env(slot))

    def close(self) -> None:
        pass


class Ray:
    """Trials as Ray tasks, each running the trial's process where Ray places it."""

    def __init__(self, address: str | None = None):
        try:
            import ray
        except ImportError:
            raise SystemExit("error: --backend ray needs ray: pip install -e '.[ray]'") from None
        self.ray = ray
        ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        gpus = int(ray.cluster_resources().get("GPU", 0))
        self.task = ray.remote(num_gpus=1 if gpus else 0, num_cpus=0 if gpus else 1, max_retries=0)(_run)
        self.cwd = os.getcwd()

    def slots(self, parallel: int) -> int:
        """`parallel`: Ray queues a task until a GPU (or CPU) is free."""
        return parallel

    def start(self, command: list[str], trial_dir: str, slot: int):
        return RayTrial(self.ray, self.task.remote(_absolute(command), os.path.abspath(trial_dir), self.cwd))

    def close(self) -> None:
        self.ray.shutdown()


class RayTrial:
    """A Ray task's handle shaped like Popen's."""

    def __init__(self, ray, ref):
        self.ray, self.ref, self.returncode = ray, ref, None

    def poll(self) -> int | None:
        if self.returncode is None and self.ray.wait([self.ref], timeout=0)[0]:
            try:
                self.returncode = self.ray.get(self.ref)
            except (self.ray.exceptions.RayError, self.ray.exceptions.TaskCancelledError):
                self.returncode = -signal.SIGTERM
        return self.returncode

    def terminate(self) -> None:
        self.ray.cancel(self.ref, force=True)  # kills the worker; its trial process gets SIGTERM

    def wait(self) -> int:
        while self.poll() is None:
            self.ray.wait([self.ref], timeout=1.0)
        return self.returncode


def _run(command: list[str], trial_dir: str, cwd: str) -> int:
    """Inside a Ray worker: the trial's process (GPU from Ray's CUDA_VISIBLE_DEVICES); its exit code."""
    return start_process(command, trial_dir, dict(os.environ), cwd).wait()


def _absolute(command: list[str]) -> list[str]:
    """The train command with its --config file and --workdir as absolute paths."""
    out = list(command)
    for flag in ("--config", "--workdir"):
        i = out.index(flag) + 1
        path, sep, arg = out[i].partition(":")
        out[i] = os.path.abspath(path) + sep + arg
    return out


BACKENDS = {"local": Local, "ray": Ray}


# Running trials ------------------------------------------------------------------------


def trial_command(config_spec: str, overrides: dict, trial_dir: str, group: str = "") -> list[str]:
    """The trial's train command; `group` (the sweep's name) its trackers' group, where given."""
    flags = [f"--config.{k}={v}" for k, v in {**overrides, **({"train.tracker_group": group} if group else {})}.items()]
    return [sys.executable, "-m", "transformer.train", "--config", config_spec, "--workdir", trial_dir, *flags]


def group(experiment, name: str, workdir: str) -> str:
    """The trackers' group of the sweep's trials: its workdir's name, where the trial's config has the key and
    leaves it unset."""
    train = experiment.configs[name].train if name in experiment.configs else {}
    return os.path.basename(os.path.abspath(workdir)) if train.get("tracker_group", None) == "" else ""


def write_status(trial_dir: str, record: dict) -> None:
    """Replaces the trial's record (see results.trial_status)."""
    with open(os.path.join(trial_dir, "trial.json.tmp"), "w") as f:
        json.dump(record, f, indent=2)
    os.replace(os.path.join(trial_dir, "trial.json.tmp"), os.path.join(trial_dir, "trial.json"))


@dataclasses.dataclass
class Running:
    name: str
    trial_dir: str
    process: object  # subprocess.Popen, or RayTrial
    slot: int
    started: float
    bar: object
    shown_size: int = 0  # of the metrics file when the bar was last updated


def run_trials(experiment, workdir: str, parallel: int, launcher, on_change=None, stop_at: int = 0) -> dict[str, str]:
    """Runs the unfinished trials of `experiment` (an experiments.Experiment) through `launcher`,
    `parallel` at a time, each up to step `stop_at` if given; returns {trial name: final status}."""
    pending, statuses = [], {}
    for name, overrides in experiment.trials.items():
        directory = results.trial_dir(workdir, name)
        os.makedirs(directory, exist_ok=True)
        record = results.trial_status(directory)
        if "overrides" not in record:
            write_status(directory, {**record, "overrides": overrides})
        statuses[name] = record["status"]
        if statuses[name] not in results.ENDED:
            pending.append((name, {**overrides, **({"train.stop_at": stop_at} if stop_at else {})}))
    overall = console.progress(total=len(experiment.trials), initial=len(experiment.trials) - len(pending),
                           desc="trials", position=0, dynamic_ncols=True)
    running, free, announced = [], list(range(parallel)), set()
    try:
        while pending or running:
            for name, overrides in list(pending):
                trial_dir = results.trial_dir(workdir, name)
                if free and _unlocked(trial_dir, name, announced):
                    pending.remove((name, overrides))
                    grouped = group(experiment, name, workdir)
                    command = trial_command(experiment.config_spec, overrides, trial_dir, grouped)
                    running.append(_start(command, trial_dir, free.pop(0), launcher))
            time.sleep(1.0)
            for r in list(running):
                _show_progress(r)
                if r.process.poll() is not None:
                    statuses[r.name] = _finish(r)
                    running.remove(r)
                    free.append(r.slot)
                    overall.update(1)
                    if on_change:
                        on_change()
    finally:
        for r in running:
            r.process.terminate()
        for r in running:
            r.process.wait()
            _finish(r)
        overall.close()
    return statuses


def _start(command: list[str], trial_dir: str, slot: int, launcher) -> Running:
    name = os.path.basename(trial_dir)
    process = launcher.start(command, trial_dir, slot)
    started, previous = time.time(), results.trial_status(trial_dir)
    write_status(trial_dir, {"status": "running", "overrides": previous["overrides"],
                             "wall_s": previous.get("wall_s", 0.0), "started": started})
    bar = console.progress(desc=f"{name}: starting", position=slot + 1, leave=False, dynamic_ncols=True,
                       bar_format="{desc}")
    return Running(name, trial_dir, process, slot, started, bar)


def _unlocked(trial_dir: str, name: str, announced: set) -> bool:
    """Whether no process of an earlier sweep (killed, so its trials save and exit) still runs the
    trial, on whichever host: it would hold the trial's lock. Says so once per trial."""
    lock = lock_trial(trial_dir, blocking=False)
    if lock is None:
        if name not in announced:
            announced.add(name)
            tqdm.write(f"trial {name}: waiting for its process from an earlier sweep to exit "
                       f"(it holds {os.path.join(trial_dir, LOCK)})", file=sys.stderr)
        return False
    os.close(lock)
    return True


def _show_progress(r: Running) -> None:
    """The trial's line: its last logged step and loss (the metrics are read when they grew)."""
    path = os.path.join(r.trial_dir, "metrics.jsonl")
    size = os.path.getsize(path) if os.path.exists(path) else 0
    if size == r.shown_size:
        return
    r.shown_size = size
    records = [x for x in results.records_of(r.trial_dir) if "train/loss" in x]
    if records:
        r.bar.set_description_str(f"{r.name}: step {records[-1]['step']}, loss {records[-1]['train/loss']:.4f}")


def _finish(r: Running) -> str:
    """Records how the trial ended: done (all its steps), failed (with its error), or paused
    (interrupted, or at a rung of successive halving)."""
    previous, ended = results.trial_status(r.trial_dir), time.time()
    ok = r.process.returncode == 0
    record = {"status": "done" if ok and reached_end(r.trial_dir) else "failed" if not ok else "paused",
              "overrides": previous["overrides"], "wall_s": previous.get("wall_s", 0.0) + ended - r.started,
              "started": r.started, "ended": ended}
    if not ok:
        record["error"] = _last_error(os.path.join(r.trial_dir, "trial.log"), r.process.returncode)
        tqdm.write(f"trial {r.name} failed: {record['error']}")
    write_status(r.trial_dir, record)
    r.bar.close()
    return record["status"]


def reached_end(trial_dir: str) -> bool:
    """Whether the run logged its last step (config.train.steps)."""
    records = results.records_of(trial_dir)
    if not records:
        return False
    from transformer import rundir  # here: the sweep's own process imports no jax until a trial has run

    steps = rundir.open(trial_dir).config.train.steps
    return any(r["step"] >= steps for r in records)


def write_report(workdir: str, metric: str, mode: str) -> list[dict]:
    """results.write, returning its rows; a failure is one warning line and no rows, and the sweep goes on."""
    try:
        return results.write(workdir, metric, mode)
    except Exception as e:
        tqdm.write(f"warning: the results in {workdir} were not rewritten: {type(e).__name__}: "
                   f"{cli.one_line(e)[:300]}", file=sys.stderr)
        return []


def _last_error(log_path: str, returncode: int) -> str:
    with open(log_path, errors="replace") as f:
        lines = [line.strip() for line in f.read().splitlines()[-200:] if line.strip()]
    errors = [line for line in lines if line.startswith("error") or "Error" in line]
    return (errors or lines or [f"exit code {returncode}"])[-1][:500]
