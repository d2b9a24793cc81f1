"""The host, set before a command starts: glibc malloc to keep what it maps, and libtpu quiet without TPUs.

XLA:CPU allocates a train step's temporaries as one block afresh on every step (up to several
GiB at gpt2-small). glibc maps a block that large straight from the kernel and unmaps it on free,
so without the tunables below every step faults its temporaries in again and the kernel zeroes
them. These glibc tunables (GLIBC_TUNABLES, read when a process starts) make malloc keep that
memory instead:

  glibc.malloc.hugetlb=1            2 MiB transparent huge pages for what malloc maps (glibc 2.35+)
  glibc.malloc.mmap_max=0           large blocks come from the heap, not one mmap each
  glibc.malloc.arena_max=1          one heap for every thread (a thread's own arena mmaps a block
                                    over 64 MiB whatever mmap_max says)
  glibc.malloc.trim_threshold=2^40  freed memory stays mapped for the next step

With them a step takes no page faults (experiments/bench/RESULTS.md measures it), and the
process holds its peak memory until it exits. `tune_malloc()`
re-executes the command once with the tunables; the package runs it on import when the process
was started as one of its commands (`python -m transformer.X`), never inside a user's program.
Nothing computed changes. A tunable the environment already sets is kept as it is;
TRANSFORMER_TUNE_MALLOC=0 turns all of this off. Hosts that run JAX on an accelerator (JAX_PLATFORMS
naming one, or, without it, a GPU or TPU plugin installed and its device present) and other systems are
left alone: their steps' temporaries are device memory, and a host process there should give back what it
frees.

libtpu (the `tpu` extra, for compiling for a TPU slice here) tries to start on every JAX process and, on a
host without TPUs, prints six lines of warnings about the accelerator type and worker hostnames.
`quiet_libtpu()` gives it the values it looks for (environment defaults, only where no TPU is present).
"""

import glob
import importlib.util
import os
import sys

TUNABLES = {"glibc.malloc.hugetlb": "1", "glibc.malloc.mmap_max": "0", "glibc.malloc.arena_max": "1",
            "glibc.malloc.trim_threshold": str(2**40)}
GOOGLE_PCI = "0x1ae0"


def started_as_a_command() -> bool:
    """Whether this process is `python [options] -m transformer.X ...`."""
    argv = getattr(sys, "orig_argv", [])
    return any(a == "-m" and b.startswith("transformer.") for a, b in zip(argv, argv[1:]))


def runs_on_cpu() -> bool:
    """Whether JAX will compute on the host: JAX_PLATFORMS starts with cpu, or, unset, no accelerator
    plugin is installed (looked up, not imported)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0] == "cpu"
    tpu = importlib.util.find_spec("libtpu") is not None and has_tpus()
    gpu = importlib.util.find_spec("jax_plugins") is not None and has_gpus()
    return not (tpu or gpu)


def has_tpus() -> bool:
    """Whether this host has TPU chips: a Google PCI device (v5 and later) or an /dev/accel node (v2 to v4)."""
    return bool(glob.glob("/dev/accel*")) or any(_read(path) == GOOGLE_PCI
                                                 for path in glob.glob("/sys/bus/pci/devices/*/vendor"))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def has_gpus() -> bool:
    """Whether this host has an NVIDIA or AMD GPU's device node."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def quiet_libtpu() -> None:
    """Environment defaults that keep libtpu quiet where it is installed and no TPU is present."""
    if importlib.util.find_spec("libtpu") is None or has_tpus():
        return
    for key, value in dict(TPU_SKIP_MDS_QUERY="1", TPU_WORKER_HOSTNAMES="localhost",
                           TPU_ACCELERATOR_TYPE="v5litepod-1").items():
        os.environ.setdefault(key, value)


def tune_malloc() -> None:
    """Re-executes this process with TUNABLES added to GLIBC_TUNABLES (Linux, once)."""
    given = os.environ.get("GLIBC_TUNABLES", "")
    names = {item.split("=")[0] for item in given.split(":") if item}
    if (not sys.platform.startswith("linux") or "glibc.malloc.hugetlb" in names
            or os.environ.get("TRANSFORMER_TUNE_MALLOC") == "0" or not runs_on_cpu()):
        return
    added = [f"{name}={value}" for name, value in TUNABLES.items() if name not in names]
    os.environ["GLIBC_TUNABLES"] = ":".join(([given] if given else []) + added)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)
