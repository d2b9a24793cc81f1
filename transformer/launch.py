"""Where a sweep's trials run: local processes, or Ray tasks on a cluster.

A launcher starts a trial's command with its output appended to a log file and returns a
handle with `poll()` (the exit code, or None while it runs), `terminate()` and `wait()`,
as `subprocess.Popen` has. Each trial is its own `python -m transformer.train` process
either way, so it owns its devices: one GPU per trial where there are GPUs.

  local   processes on this machine; slot i of --parallel gets GPU i (CUDA_VISIBLE_DEVICES)
  ray     Ray tasks (`ray.init(address)`; a local Ray instance when no address is given),
          one GPU each on a cluster with GPUs, else one CPU; paths are made absolute and the
          trial runs in the sweep's working directory, which every node must see (a shared
          filesystem), as must the workdir
"""

import ctypes
import os
import signal
import subprocess
import sys


def die_with_parent() -> None:
    """In a child (Linux): SIGTERM when its parent dies, so the trial saves and exits."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_process(command: list[str], log_path: str, env: dict, cwd: str | None = None) -> subprocess.Popen:
    with open(log_path, "a") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)


def count_gpus() -> int:
    """NVIDIA GPUs on this host, without importing jax (which would claim them)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


class Local:
    """Trials as processes on this machine."""

    def __init__(self):
        self.gpus = count_gpus()

    def start(self, command: list[str], log_path: str, slot: int):
        env = dict(os.environ)
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(slot % self.gpus)
        return start_process(command, log_path, env)

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

    def start(self, command: list[str], log_path: str, slot: int):
        return RayTrial(self.ray, self.task.remote(_absolute(command), os.path.abspath(log_path), self.cwd))

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


def _run(command: list[str], log_path: str, cwd: str) -> int:
    """Inside a Ray worker: the trial's process (GPU from Ray's CUDA_VISIBLE_DEVICES); its exit code."""
    return start_process(command, log_path, dict(os.environ), cwd).wait()


def _absolute(command: list[str]) -> list[str]:
    """The train command with its --config file and --workdir as absolute paths."""
    out = list(command)
    for flag in ("--config", "--workdir"):
        i = out.index(flag) + 1
        path, sep, arg = out[i].partition(":")
        out[i] = os.path.abspath(path) + sep + arg
    return out


BACKENDS = {"local": Local, "ray": Ray}
