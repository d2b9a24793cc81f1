"""transformer/hostmem.py: commands re-execute once with glibc's huge pages; programs are left alone."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHOW = ("import os, sys; from transformer import hostmem; print('start', os.getpid(), flush=True); "
        "hostmem.use_huge_pages(); print('tunables', os.environ.get('GLIBC_TUNABLES'), "
        "hostmem.started_as_a_command())")


def run(code, **env):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "TRANSFORMER_HUGE_PAGES")} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                          check=True).stdout.split("\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables: Linux")
def test_use_huge_pages_re_executes_once_with_the_tunable_kept_beside_others():
    out = run(SHOW, GLIBC_TUNABLES="glibc.malloc.arena_max=2")
    starts = [line for line in out if line.startswith("start")]
    assert len(starts) == 2 and starts[0] == starts[1]  # the same process, executed twice
    assert "tunables glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1 False" in out


def test_opting_out_or_importing_the_package_changes_nothing():
    out = run(SHOW, TRANSFORMER_HUGE_PAGES="0")
    assert sum(line.startswith("start") for line in out) == 1 and "tunables None False" in out
    out = run("import os, transformer; print(os.environ.get('GLIBC_TUNABLES'))")
    assert out[0] == "None"  # `import transformer` in a user's program: no re-execution
