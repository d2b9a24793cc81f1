"""Multi-host training: two processes on localhost train exactly as one process with all their devices (GRPO's
rollouts too, each process decoding its share)."""

import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time

import numpy as np
import pytest
from conftest import FAST_COMPILES, REPO, SMALL_GPT
from flax import traverse_util
from test_grpo_task import chat_run  # noqa: F401 (a fixture)

from transformer import parallel, rundir
from transformer.training import metrics as metrics_lib

TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A small BERT pretrained with next-sentence prediction: its batches are drawn per process too.
SMALL_BERT_NSP = [
    "model.num_layers=2", "model.d_model=32", "model.num_heads=4", "model.mlp_dim=64", "model.max_len=32",
    "model.nsp=true", "model.vocab_size=400", "data.vocab_size=400", "data.seq_len=24", "data.batch_size=8",
    f"data.source={sysconfig.get_paths()['stdlib']}/json/*.py", "data.eval_fraction=0.3", "data.eval_batches=2",
    "optim.warmup_steps=1", "train.steps=6", "train.log_every=1", "train.eval_every=3", "train.checkpoint_every=3",
]
RUNS = {"gpt": ("configs/gpt.py:tiny", SMALL_GPT), "bert": ("configs/bert.py:tiny", SMALL_BERT_NSP)}


def start(workdir, devices: int, process_id: int = 0, coordinator: str = "", overrides=(), family="gpt"):
    """`python -m transformer.train` on a small GPT (or BERT) with `devices` fake CPU devices (not
    conftest's 8), one of a 2-process run when given a `coordinator`; its output goes to
    WORKDIR.PROCESS_ID.log."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {FAST_COMPILES}",
           "JAX_PLATFORMS": "cpu"}
    spec, small = RUNS[family] if isinstance(family, str) else family  # or a (config, overrides) of its own
    flags = [f"--config.{o}" for o in (*small, *overrides)]
    if coordinator:
        flags += ["--coordinator", coordinator, "--num_processes", "2", "--process_id", str(process_id)]
    with open(f"{workdir}.{process_id}.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "transformer.train", "--config", spec,
                                 "--workdir", str(workdir), *flags], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, text=True)


def start_two(workdir, overrides=(), family="gpt") -> list[subprocess.Popen]:
    """Processes 0 and 1 of a run with 2 fake devices each, meeting on a free localhost port."""
    coordinator = f"127.0.0.1:{free_port()}"
    return [start(workdir, 2, i, coordinator, overrides, family) for i in range(2)]


def finish(procs: list[subprocess.Popen]) -> list[int]:
    """Their exit codes; a process still running after TIMEOUT_S (a hang) fails the test, all killed."""
    try:
        return [p.wait(timeout=TIMEOUT_S) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"a training process still ran after {TIMEOUT_S} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def log_of(workdir, name) -> str:
    with open(f"{workdir}.{name}.log") as f:
        return f.read()


def by_step(workdir, key) -> dict[int, float]:
    return {r["step"]: r[key] for r in metrics_lib.read(os.path.join(workdir, "metrics.jsonl")) if key in r}


@pytest.mark.slow
@pytest.mark.parametrize("family, mesh", [
    ("gpt", ["mesh.data=2", "mesh.fsdp=-1"]), ("bert", ["mesh.data=1", "mesh.fsdp=-1"]),
    ("gpt", ["mesh.data=1", "mesh.context=-1", "model.attention=ring", "model.positions=rotary",
             "model.attention_block=4", "train.sample_tokens=0"]),
], ids=["gpt-data-across-hosts", "bert-nsp-fsdp-across-hosts", "gpt-ring-across-hosts"])
def test_two_processes_train_like_one_process_with_their_devices(tmp_path, family, mesh):
    """GPT on data x fsdp (with its per-eval sample from sharded parameters), BERT on fsdp alone, ring
    attention's context axis over both processes' devices."""
    one, two = tmp_path / "one", tmp_path / "two"
    codes = finish([start(one, 4, overrides=mesh, family=family)]) + finish(start_two(two, mesh, family))
    assert codes == [0, 0, 0], "\n".join(log_of(w, n)[-2000:] for w, n in ((one, 0), (two, 0), (two, 1)))
    for key in ("train/loss", "eval/loss"):
        expected, got = by_step(one, key), by_step(two, key)
        assert sorted(got) == sorted(expected) and len(got) >= 2
        np.testing.assert_allclose([got[s] for s in sorted(got)], [expected[s] for s in sorted(got)], rtol=1e-5)
    assert "step 6: eval/loss" in log_of(two, 0) and "eval/loss" not in log_of(two, 1)
    assert sorted(os.listdir(two / "checkpoints")) == ["3", "6"]
    restore = lambda w: traverse_util.flatten_dict(
        rundir.open(str(w)).restore_params(), sep="/")
    expected, got = restore(one), restore(two)
    assert sorted(got) == sorted(expected)
    for name, value in got.items():  # (key biases have no gradient but rounding noise, ~1e-6: atol 1e-5)
        np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_two_processes_run_grpo_like_one_process(tmp_path, chat_run):  # noqa: F811 (the fixture)
    """GRPO with its KL (the reference's log-probs) on 2 x 2 devices: each process rolls out half the prompts
    with the gathered params (`inference.hosts`), and the run is the 4-device one's."""
    chat, prompts = chat_run
    grpo = (f"configs/grpo.py:init_from={chat}", [
        f"data.train_path={prompts}", f"data.eval_path={prompts}", "data.batch_size=8", "data.eval_batches=1",
        "data.seq_len=16", "grpo.group_size=2", "grpo.max_new_tokens=4", "grpo.eval_prompts=3",
        "grpo.rewards=numeric,format=0.5", "grpo.kl_weight=0.1", "optim.lr=1e-2", "optim.warmup_steps=0",
        "train.steps=4", "train.log_every=1", "train.eval_every=4", "train.checkpoint_every=4"])
    one, two = tmp_path / "one", tmp_path / "two"
    codes = finish([start(one, 4, family=grpo)]) + finish(start_two(two, family=grpo))
    assert codes == [0, 0, 0], "\n".join(log_of(w, n)[-2000:] for w, n in ((one, 0), (two, 0), (two, 1)))
    for key in ("train/loss", "train/reward", "eval/reward"):
        expected, got = by_step(one, key), by_step(two, key)
        assert sorted(got) == sorted(expected) and got, key
        np.testing.assert_allclose([got[s] for s in sorted(got)], [expected[s] for s in sorted(got)], rtol=1e-5)
    with open(one / "rollouts" / "eval_000004.jsonl") as a, open(two / "rollouts" / "eval_000004.jsonl") as b:
        assert a.read() == b.read()


@pytest.mark.slow
def test_a_signal_to_one_process_stops_both_at_the_same_saved_step(tmp_path):
    workdir = tmp_path / "run"
    procs = start_two(workdir, ["train.steps=100000", "train.log_every=4", "train.eval_every=100000",
                                "train.checkpoint_every=100000"])
    deadline = time.monotonic() + TIMEOUT_S
    while not os.path.exists(workdir / "metrics.jsonl") or not by_step(workdir, "train/loss"):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), log_of(workdir, 0)[-2000:]
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGINT)
    assert finish(procs) == [0, 0], log_of(workdir, 0)[-2000:] + log_of(workdir, 1)[-2000:]
    saved = os.listdir(workdir / "checkpoints")
    assert len(saved) == 1 and int(saved[0]) % 4 == 0, saved
    assert f"another process got a signal: saved a checkpoint at step {saved[0]}" in log_of(workdir, 0)
    assert f"SIGINT: saved a checkpoint at step {saved[0]}" in log_of(workdir, 1)


@pytest.mark.parametrize("override,errors", [
    ("data.source=/no/such/file.txt",  # found by every process in its checks, before any work
     ("no files match '/no/such/file.txt'",) * 2),
    ("data.batch_size=6", ("config.data.batch_size=6 must divide by the 4-way batch split",) * 2),
])
def test_a_mistake_stops_both_processes_in_one_line(tmp_path, override, errors):
    workdir = tmp_path / "run"
    assert finish(start_two(workdir, [override])) == [2, 2]  # a user's mistake: exit code 2
    for process, error in enumerate(errors):
        lines = [line for line in log_of(workdir, process).splitlines() if line.startswith("error: ")]
        assert len(lines) == 1 and error in lines[0], log_of(workdir, process)[-2000:]


def test_the_multi_host_flags_go_together():
    with pytest.raises(ValueError, match="--num_processes and --process_id missing"):
        parallel.initialize(coordinator="127.0.0.1:1234")


@pytest.mark.parametrize("env,cluster", [
    ({}, None),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
      "SLURM_LOCALID": "0"}, None),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
      "SLURM_LOCALID": "0"}, "SLURM"),
    ({"SLURM_NTASKS": "4"}, None),  # inside salloc, not launched by srun
    ({"TPU_WORKER_HOSTNAMES": "host-0"}, None),
    ({"TPU_WORKER_HOSTNAMES": "host-0,host-1"}, "Cloud TPU"),
])
def test_a_cluster_is_detected_only_when_it_runs_several_processes(monkeypatch, env, cluster):
    for name in (*parallel.SLURM_VARS, *parallel.TPU_HOSTS_VARS, "MEGASCALE_NUM_SLICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert parallel.detected_cluster() == cluster
