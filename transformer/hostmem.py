"""Host memory for XLA:CPU: huge pages for glibc malloc's large blocks, set before a command starts.

XLA:CPU allocates a train step's temporaries afresh on every step. glibc maps blocks above its
mmap threshold (32 MiB at most) straight from the kernel and unmaps them on free, so each step
faults its temporaries in again, 4 KiB at a time: at issue 21's first shape (941 MiB of temps)
236,000 page faults and 0.36 s of system time per 1.03 s step on 2 cores. glibc 2.35+ backs those
blocks with 2 MiB transparent huge pages when GLIBC_TUNABLES has `glibc.malloc.hugetlb=1` (600
faults; the same step took 0.87 s, experiments/bench/RESULTS.md). The tunable is read when a
process starts, so `use_huge_pages()` re-executes the command once with it set; the package runs
it on import when the process was started as one of its commands (`python -m transformer.X`),
never inside a user's program. Nothing computed changes. TRANSFORMER_HUGE_PAGES=0 turns it off;
glibc older than 2.35 ignores the tunable; other systems are left alone.
"""

import os
import sys

TUNABLE = "glibc.malloc.hugetlb=1"


def started_as_a_command() -> bool:
    """Whether this process is `python [options] -m transformer.X ...`."""
    argv = getattr(sys, "orig_argv", [])
    return any(a == "-m" and b.startswith("transformer.") for a, b in zip(argv, argv[1:]))


def use_huge_pages() -> None:
    """Re-executes this process with GLIBC_TUNABLES including `glibc.malloc.hugetlb=1` (Linux, once)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (not sys.platform.startswith("linux") or "glibc.malloc.hugetlb" in tunables
            or os.environ.get("TRANSFORMER_HUGE_PAGES") == "0"):
        return
    os.environ["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}" if tunables else TUNABLE
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)
