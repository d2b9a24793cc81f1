"""Sweeps: expansion helpers, a parallel local sweep, a failing trial, and a killed sweep resumed."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from transformer import report, sweep

TINY = ("configs/gpt.py:tiny,model.num_layers=1,model.d_model=32,model.num_heads=2,model.mlp_dim=64,"
        "model.max_len=32,data.seq_len=16,data.batch_size=8,data.eval_batches=2,optim.warmup_steps=2,"
        "train.log_every=5,train.eval_every=10,train.checkpoint_every=10,train.sample_tokens=0")


def test_grid_zip_product_and_random_expand_as_documented():
    assert sweep.grid({"a": [1, 2], "b": ["x", "y"]}) == [
        {"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]
    assert sweep.zipped({"a": [1, 2], "b": [3, 4]}) == [{"a": 1, "b": 3}, {"a": 2, "b": 4}]
    with pytest.raises(ValueError, match="differ in length"):
        sweep.zipped({"a": [1, 2], "b": [3]})
    assert sweep.product(sweep.grid({"a": [1, 2]}), sweep.zipped({"b": [3], "c": [4]})) == [
        {"a": 1, "b": 3, "c": 4}, {"a": 2, "b": 3, "c": 4}]
    axes = {"lr": sweep.log_uniform(1e-4, 1e-2), "drop": sweep.uniform(0.0, 0.2),
            "width": sweep.choice([64, 128])}
    trials = sweep.random(20, axes, seed=3)
    assert trials == sweep.random(20, axes, seed=3) != sweep.random(20, axes, seed=4)
    assert all(1e-4 <= t["lr"] <= 1e-2 and 0 <= t["drop"] <= 0.2 and t["width"] in (64, 128) for t in trials)
    assert {t["width"] for t in trials} == {64, 128}
    assert sweep.trial_name({"optim.lr": 0.001, "data.source": "a b/*.txt"}) == "optim.lr=0.001,data.source=a_b__.txt"


def write_experiment(tmp_path, trials: str, steps: int = 20) -> str:
    path = tmp_path / "exp.py"
    path.write_text(f"from transformer import sweep\n\nCONFIG = {TINY + f',train.steps={steps}'!r}\n\n\n"
                    f"def get_sweep():\n    return {trials}\n")
    return str(path)


def run_sweep(experiment, workdir, *flags, wait=True):
    command = [sys.executable, "-m", "transformer.sweep", "--experiment", experiment, "--workdir", str(workdir),
               *flags]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if not wait:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def statuses(workdir):
    return {r["trial"]: r["status"] for r in csv.DictReader(open(workdir / "results.csv"))}


@pytest.mark.slow
def test_four_trials_two_at_a_time_write_results_and_plots(tmp_path):
    experiment = write_experiment(tmp_path, 'sweep.grid({"optim.lr": [1e-3, 3e-3], "model.d_model": [32, 48]})')
    done = run_sweep(experiment, tmp_path / "sw", "--parallel", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert set(statuses(tmp_path / "sw").values()) == {"done"} and len(statuses(tmp_path / "sw")) == 4
    rows = report.collect(str(tmp_path / "sw"))
    top = report.best(rows, "eval/loss", "min")
    assert top["best eval/loss"] == min(r["best eval/loss"] for r in rows) and top["steps"] == 20
    assert f"**{top['trial']}**" in (tmp_path / "sw" / "results.md").read_text()
    assert all((tmp_path / "sw" / name).stat().st_size > 1000 for name in ("metric.png", "curves.png"))
    again = run_sweep(experiment, tmp_path / "sw", "--parallel", "2")
    assert again.returncode == 0 and "4 of 4 trials done" in again.stderr
    assert all(open(p).read().count("steps 0->20") == 1 for p in (tmp_path / "sw" / "trials").glob("*/trial.log"))


@pytest.mark.slow
def test_a_failing_trial_is_recorded_and_the_others_finish(tmp_path):
    experiment = write_experiment(tmp_path, 'sweep.grid({"model.num_heads": [2, 5]})')
    result = run_sweep(experiment, tmp_path / "sw", "--parallel", "2")
    assert result.returncode == 1
    assert statuses(tmp_path / "sw") == {"model.num_heads=2": "done", "model.num_heads=5": "failed"}
    failed = json.load(open(tmp_path / "sw" / "trials" / "model.num_heads=5" / "trial.json"))
    assert "not divisible by num_heads=5" in failed["error"]
    assert "not done: model.num_heads=5" in result.stderr


@pytest.mark.slow
def test_a_killed_sweep_reruns_without_redoing_finished_trials(tmp_path):
    experiment = write_experiment(tmp_path, 'sweep.grid({"optim.lr": [1e-3, 2e-3, 3e-3]})', steps=60)
    workdir = tmp_path / "sw"
    process = run_sweep(experiment, workdir, wait=False)
    trials = workdir / "trials"
    second = trials / "optim.lr=0.002" / "metrics.jsonl"  # trials run in order, one at a time
    deadline = time.time() + 300
    while time.time() < deadline and not (second.exists() and second.read_text().strip()):
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)  # its trial gets SIGTERM, saves and exits; the rerun waits for it
    process.wait()
    finished = {d.name for d in trials.glob("*") if sweep.trial_status(str(d))["status"] == "done"}
    assert finished
    result = run_sweep(experiment, workdir, "--parallel", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert set(statuses(workdir).values()) == {"done"}
    resumed = 0
    for d in trials.glob("*"):
        launches = re.findall(r"steps (\d+)->60", open(d / "trial.log").read())
        if d.name in finished:
            assert launches == ["0"]
        elif len(launches) == 2:
            resumed += 1
            assert int(launches[1]) > 0  # from the checkpoint saved on SIGTERM
    assert resumed >= 1


@pytest.mark.slow
def test_successive_halving_stops_the_worse_half_at_each_rung(tmp_path):
    experiment = write_experiment(tmp_path, 'sweep.grid({"optim.lr": [1e-4, 3e-4, 1e-3, 3e-3]})', steps=30)
    result = run_sweep(experiment, tmp_path / "sw", "--parallel", "2", "--halving", "10,20")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1 of 4 trials done, 3 stopped early" in result.stderr
    rows = {r["trial"]: r for r in report.collect(str(tmp_path / "sw"))}
    assert [rows[t]["steps"] for t in sorted(rows)] == [10, 10, 20, 30]  # lr 1e-4, 3e-4, 1e-3, 3e-3
    at_10 = {t: sweep.metric_at(str(tmp_path / "sw" / "trials" / t), "eval/loss", 10) for t in rows}
    assert sorted(at_10, key=at_10.get)[:2] == ["optim.lr=0.003", "optim.lr=0.001"]
    assert rows["optim.lr=0.001"]["error"].startswith("stopped at step 20")


@pytest.mark.slow
def test_the_ray_backend_runs_the_same_sweep_on_a_local_ray_instance(tmp_path):
    experiment = write_experiment(tmp_path, 'sweep.grid({"optim.lr": [1e-3, 3e-3]})')
    local = run_sweep(experiment, tmp_path / "local", "--parallel", "2")
    on_ray = run_sweep(experiment, tmp_path / "ray", "--parallel", "2", "--backend", "ray")
    assert local.returncode == 0 and on_ray.returncode == 0, on_ray.stderr[-2000:]
    rows = {d: {r["trial"]: r for r in report.collect(str(tmp_path / d))} for d in ("local", "ray")}
    assert set(rows["ray"]) == {"optim.lr=0.001", "optim.lr=0.003"}
    for trial, row in rows["ray"].items():
        assert row["status"] == "done" and row["best eval/loss"] == pytest.approx(rows["local"][trial]["best eval/loss"])
