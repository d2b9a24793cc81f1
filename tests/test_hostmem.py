"""transformer/hostmem.py: commands re-execute once with glibc malloc tuned to keep what it maps;
programs are left alone."""

import importlib.util
import os
import subprocess
import sys

import pytest

from transformer import hostmem

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHOW = ("import os, sys; from transformer import hostmem; print('start', os.getpid(), flush=True); "
        "hostmem.tune_malloc(); print('tunables', os.environ.get('GLIBC_TUNABLES'), "
        "hostmem.started_as_a_command())")
# Allocates, fills and frees 256 MiB twice; prints the minor page faults of the second time.
REFAULTS = ("import resource, numpy as np; from transformer import hostmem; hostmem.tune_malloc()\n"
            "faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "x = np.ones(2**25); del x\n"
            "before = faults(); x = np.ones(2**25); print(faults() - before)")
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables: Linux")


def run(code, **env):
    unset = ("GLIBC_TUNABLES", "TRANSFORMER_TUNE_MALLOC", "JAX_PLATFORMS")
    env = {k: v for k, v in os.environ.items() if k not in unset} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                          check=True).stdout.split("\n")


@linux
def test_tune_malloc_re_executes_once_keeping_the_tunables_the_environment_sets():
    out = run(SHOW, GLIBC_TUNABLES="glibc.malloc.arena_max=2", JAX_PLATFORMS="cpu")
    starts = [line for line in out if line.startswith("start")]
    assert len(starts) == 2 and starts[0] == starts[1]  # the same process, executed twice
    ours = [f"{k}={v}" for k, v in hostmem.TUNABLES.items() if k != "glibc.malloc.arena_max"]
    assert f"tunables {':'.join(['glibc.malloc.arena_max=2', *ours])} False" in out


@linux
def test_a_tuned_process_reuses_a_freed_large_block_without_faulting_it_in_again():
    assert int(run(REFAULTS, JAX_PLATFORMS="cpu")[0]) < 10
    # 128 huge pages or 65,536 small ones
    assert int(run(REFAULTS, JAX_PLATFORMS="cpu", TRANSFORMER_TUNE_MALLOC="0")[0]) >= 100


def test_opting_out_an_accelerator_or_importing_the_package_changes_nothing():
    for env in ({"TRANSFORMER_TUNE_MALLOC": "0"}, {"JAX_PLATFORMS": "cuda"}, {"JAX_PLATFORMS": "tpu,cpu"}):
        out = run(SHOW, **env)
        assert sum(line.startswith("start") for line in out) == 1 and "tunables None False" in out, env
    out = run("import os, transformer; print(os.environ.get('GLIBC_TUNABLES'))")
    assert out[0] == "None"  # `import transformer` in a user's program: no re-execution


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None or hostmem.has_tpus(),
                    reason="libtpu installed on a host without TPUs")
def test_libtpu_starts_quietly_on_a_host_without_tpus_and_the_host_counts_as_a_cpu():
    code = "import transformer, jax; print(jax.devices()[0].platform)"
    unset = ("TPU_SKIP_MDS_QUERY", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "JAX_PLATFORMS")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, check=True)
    assert done.stdout.strip() == "cpu" and "TPU" not in done.stderr, done.stderr
    assert hostmem.runs_on_cpu()
