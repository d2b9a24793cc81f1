"""Sweeps: expansion helpers, experiment files and their errors, trial names, halving decisions, GPU slots and
trial locks (records and reports: test_sweep_results.py); then (slow) a parallel local sweep, a failing trial, a
killed sweep resumed, successive halving and the Ray backend."""

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from absl import flags
from conftest import FAST_COMPILES, REPO
from ml_collections import config_flags

from transformer import config as config_lib
from transformer import sweep
from transformer.sweep import experiments, halving, launch, results

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
    name = experiments.trial_name({"optim.lr": 0.001, "data.source": "a b/*.txt"})
    assert name == "optim.lr=0.001,data.source=a_b__.txt"


def write_experiment(tmp_path, trials: str, steps: int = 20) -> str:
    path = tmp_path / "exp.py"
    path.write_text(f"from transformer import sweep\n\nCONFIG = {TINY + f',train.steps={steps}'!r}\n\n\n"
                    f"def get_sweep():\n    return {trials}\n")
    return str(path)


def run_sweep(experiment, workdir, *flags, wait=True):
    command = [sys.executable, "-m", "transformer.sweep", "--experiment", experiment, "--workdir", str(workdir),
               *flags]
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILES}
    if not wait:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def statuses(workdir):
    return {r["trial"]: r["status"] for r in csv.DictReader(open(workdir / "results.csv"))}


# Experiment files ----------------------------------------------------------------------


def load_like_train(command: list[str]):
    """A trial's config, loaded from its command's --config flags as transformer.train does."""
    argv = [command[0], "--config", command[command.index("--config") + 1],
            *(a for a in command if a.startswith("--config."))]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=values, lock_config=True, sys_argv=argv)
    values(argv)
    return values.config


@pytest.mark.parametrize("config_arg", ["", "train.steps=7"])
def test_an_experiment_with_its_own_get_config_gets_its_config_arg(tmp_path, config_arg):
    steps = config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny," + config_arg)).train.steps
    path = tmp_path / "own.py"
    path.write_text("from transformer import config as config_lib, sweep\n\n"
                    + (f"CONFIG_ARG = {config_arg!r}\n" if config_arg else "")
                    + "\n\ndef get_config(arg):\n"
                    f"    return config_lib.load({os.path.join(REPO, 'configs/gpt.py')!r} + ':tiny,' + arg)\n\n\n"
                    "def get_sweep():\n    return sweep.grid({'optim.lr': [1e-3, 2e-3]})\n")
    experiment = experiments.load_experiment(str(path))
    assert experiment.config_spec == f"{path}:{config_arg}" and experiment.steps == steps
    for name, overrides in experiment.trials.items():
        config = load_like_train(launch.trial_command(experiment.config_spec, overrides, str(tmp_path / name)))
        assert config.optim.lr == overrides["optim.lr"] and config.train.steps == steps


def write_bad_experiment(tmp_path, body: str) -> str:
    path = tmp_path / "bad.py"
    path.write_text(f"from transformer import sweep\n\nCONFIG = {TINY!r}\n\n\n{body}\n")
    return str(path)


@pytest.mark.parametrize("body,message", [
    ("def get_sweep():\n    return {'optim.lr': [1e-3]}",
     r"get_sweep\(\) returned a dict, not a list of override dicts"),
    ("def get_sweep():\n    return [{'optim.lr': 1e-3}, 'optim.lr=2e-3']",
     r"trial 2 of 2 is 'optim.lr=2e-3', not a non-empty dict"),
    ("def get_sweep():\n    return [{}]", r"trial 1 of 1 is \{\}, not a non-empty dict"),
    ("def get_sweep():\n    return 1 / 0", r"get_sweep\(\) raised ZeroDivisionError: division by zero"),
    ("import no_such_module", r"running the file raised ModuleNotFoundError: No module named 'no_such_module'"),
    ("def get_sweep(:", r"running the file raised SyntaxError"),
    ("def get_sweep():\n    return [{'optim.lr': 1e-3}, {'optim.lr': 2e-3}, {'model.nope': 1}]",
     r"trial 3 \(model.nope=1\): unknown config key model.nope; did you mean model.norm\?"),
    ("def get_sweep():\n    return [{'model.d_model': 'wide'}]", r"trial 1 \(model.d_model=wide\): config key"),
    ("def get_sweep():\n    return [{'model.num_heads': 4}, {'model.num_heads': 5}]",
     r"trial 2 \(model.num_heads=5\): .*num_heads=5"),
    ("def get_sweep():\n    return [{'optim.lr': 1e-3}, {'optim.lr': 0.001}]",
     r"lists the same trial twice \(trials 1 and 2"),
])
def test_a_bad_experiment_file_is_one_line_naming_it(tmp_path, monkeypatch, body, message):
    monkeypatch.chdir(REPO)  # CONFIG's path is relative
    path = write_bad_experiment(tmp_path, body)
    with pytest.raises(ValueError, match=message) as error:
        experiments.load_experiment(path)
    assert str(error.value).startswith(f"{path}: ") and "\n" not in str(error.value)


def test_the_cli_reports_a_bad_experiment_as_error_and_exit_code_2(tmp_path):
    path = write_bad_experiment(tmp_path, "def get_sweep():\n    return [{'model.nope': 1}]")
    result = run_sweep(path, tmp_path / "sw")
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: {path}: trial 1 (model.nope=1): unknown config key model.nope; "
                                     "did you mean model.norm?")
    assert not (tmp_path / "sw" / "trials").exists()


# Trial names ---------------------------------------------------------------------------


def test_trial_names_tell_every_different_trial_apart():
    draws = sweep.random(200, {"optim.lr": sweep.log_uniform(1e-3, 1.1e-3)})
    assert len(experiments.trial_names("x.py", draws)) == 200
    assert len(experiments.trial_names("x.py", [{"model.d_model": 128}, {"model.d_model": 128.0}])) == 2
    names = experiments.trial_names("x.py", [{"data.source": "a b"}, {"data.source": "a_b"}])
    assert len(names) == 2 and all(re.fullmatch(r"data\.source=a_b~[0-9a-f]{8}", n) for n in names)
    long = [{"data.source": "x" * 300 + str(i)} for i in range(2)]
    names = experiments.trial_names("x.py", long)
    assert len(names) == 2 and all(len(n) <= experiments.MAX_NAME and "~" in n for n in names)
    assert experiments.trial_name({"optim.lr": 0.003, "model.d_model": 192}) == "optim.lr=0.003,model.d_model=192"


@pytest.mark.parametrize("experiment", ["gpt_lr_width", "vit_patch_depth", "muon_vs_adamw", "moe_vs_dense"])
def test_the_shipped_experiments_keep_the_names_of_their_committed_trials(monkeypatch, experiment):
    monkeypatch.chdir(REPO)
    trials = experiments.load_experiment(f"experiments/{experiment}.py").trials
    assert sorted(trials) == sorted(os.listdir(f"experiments/{experiment}/trials"))


# Halving, GPUs and locks ---------------------------------------------------------------


def test_trials_on_an_image_folder_share_one_index_made_by_the_sweep(tmp_path, monkeypatch):
    from test_images import write_folder

    from transformer.data.images import folders
    write_folder(tmp_path / "folder", n=30)
    (tmp_path / "exp.py").write_text(
        f"CONFIG = 'configs/vit.py:tiny,data.source={tmp_path / 'folder'}'\n"
        "from transformer import sweep\n"
        "def get_sweep():\n    return sweep.grid({'optim.lr': [1e-3, 3e-3], 'data.test_fraction': [0.2, 0.5]})\n")
    monkeypatch.chdir(REPO)
    experiment = experiments.load_experiment(str(tmp_path / "exp.py"))
    workdir = tmp_path / "sweep"
    experiments.share_image_indexes(experiment, str(workdir))
    monkeypatch.setattr(folders, "index_folder", lambda *a, **k: pytest.fail("a trial scanned the folder again"))
    counts = set()
    for name, config in experiment.configs.items():
        trial = results.trial_dir(str(workdir), name)
        splits = folders.open_index(config.data, trial, show=False)[1]
        counts.add((config.data.test_fraction, len(splits["train"]), len(splits["test"])))
        if config.data.test_fraction == 0.5:  # the last setting indexed: the sweep's own copy is the same file
            assert os.path.samefile(os.path.join(trial, "images", "train_paths.npy"),
                                    workdir / "images" / "train_paths.npy")
    assert counts == {(0.2, 24, 6), (0.5, 15, 15)}


def test_halving_keeps_the_better_half_and_ranks_nan_last():
    scores = {"a": 1.0, "b": math.nan, "c": 0.5, "d": None, "e": 2.0}
    assert halving.halve(scores, "min") == ["c", "a"]
    assert halving.halve(scores, "max") == ["e", "a"]
    assert halving.halve({"a": math.nan, "b": 3.0}, "max") == ["b"]
    assert halving.parse_rungs("10, 20", 30) == [10, 20] and halving.parse_rungs("", 30) == []
    for bad in ("10,30", "20,10", "10,10", "0,10", "ten"):
        with pytest.raises(ValueError, match="give increasing steps from 1 to 29 \\(train.steps=30\\)"):
            halving.parse_rungs(bad, 30)


def test_trial_slots_map_to_the_visible_gpus(monkeypatch, capsys):
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 5"}) == ["3", "5"]
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "-1,2"}) == []  # CUDA stops at an invalid entry
    smi = subprocess.CompletedProcess([], 0, stdout="GPU 0: H100 (UUID: a)\nGPU 1: H100 (UUID: b)\n")
    monkeypatch.setattr(launch.subprocess, "run", lambda *args, **kwargs: smi)
    assert launch.visible_gpus({}) == ["0", "1"]
    local = launch.Local(gpus=["3", "5"])
    assert [local.env(slot)["CUDA_VISIBLE_DEVICES"] for slot in (0, 1)] == ["3", "5"]
    assert local.slots(2) == 2 and capsys.readouterr().err == ""
    assert local.slots(4) == 2 and capsys.readouterr().err.count("warning: --parallel=4 but 2 GPUs") == 1
    assert launch.Local(gpus=[]).slots(4) == 4


def test_a_trial_process_holds_its_lock_until_it_exits(tmp_path):
    process = launch.start_process([sys.executable, "-c", "import time; time.sleep(60)"], str(tmp_path),
                                   dict(os.environ))
    try:
        assert launch.lock_trial(str(tmp_path), blocking=False) is None
    finally:
        process.terminate()
        process.wait()
    os.close(launch.lock_trial(str(tmp_path), blocking=False))


LOCAL_TRIALS = ('sweep.grid({"optim.lr": [1e-3, 3e-3], "model.d_model": [32, 48]})'
                # 3 microbatches do not split the batch of 8: known only where the trial runs (its devices)
                ' + [{"optim.accum_steps": 3}]')
FAILING = "optim.accum_steps=3"


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
    """Four trials and a failing fifth, two at a time, then the same sweep again: the workdir and both
    commands' results."""
    tmp = tmp_path_factory.mktemp("local")
    experiment = write_experiment(tmp, LOCAL_TRIALS)
    first = run_sweep(experiment, tmp / "sw", "--parallel", "2")
    again = run_sweep(experiment, tmp / "sw", "--parallel", "2")
    return tmp / "sw", first, again


@pytest.mark.slow
def test_four_trials_two_at_a_time_write_results_and_plots(local_sweep):
    workdir, first, again = local_sweep
    assert first.returncode == 1 and "4 of 5 trials done" in first.stderr, first.stderr[-2000:]
    done = {t for t, status in statuses(workdir).items() if status == "done"}
    assert len(done) == 4 and set(statuses(workdir)) == done | {FAILING}
    rows = [r for r in results.collect(str(workdir)) if r["trial"] in done]
    top = results.best(rows, "eval/loss", "min")
    assert top["best eval/loss"] == min(r["best eval/loss"] for r in rows) and top["steps"] == 20
    assert f"**{top['trial']}**" in (workdir / "results.md").read_text()
    assert all((workdir / name).stat().st_size > 1000 for name in ("metric.png", "curves.png"))
    records = [results.trial_status(str(workdir / "trials" / name)) for name in done]
    spans = [(r["started"], r["ended"]) for r in records]
    assert any(a[0] < b[1] and b[0] < a[1] for a in spans for b in spans if a != b)  # two ran at once
    assert again.returncode == 1 and "4 of 5 trials done" in again.stderr, again.stderr[-2000:]
    assert all(open(workdir / "trials" / name / "trial.log").read().count("steps 0->20") == 1 for name in done)


@pytest.mark.slow
def test_a_failing_trial_is_recorded_and_the_others_finish(local_sweep):
    workdir, first, _ = local_sweep
    assert statuses(workdir)[FAILING] == "failed"
    assert set(statuses(workdir).values()) == {"done", "failed"}
    failed = json.load(open(workdir / "trials" / FAILING / "trial.json"))
    assert "config.optim.accum_steps=3" in failed["error"]
    assert f"not done: {FAILING}" in first.stderr


@pytest.mark.slow
def test_a_killed_sweep_reruns_without_redoing_finished_trials(tmp_path):
    experiment = write_experiment(tmp_path, 'sweep.grid({"optim.lr": [1e-3, 2e-3]})', steps=60)
    workdir = tmp_path / "sw"
    process = run_sweep(experiment, workdir, wait=False)
    trials = workdir / "trials"
    second = trials / "optim.lr=0.002" / "metrics.jsonl"  # trials run in order, one at a time
    deadline = time.time() + 300
    while time.time() < deadline and not (second.exists() and second.read_text().strip()):
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)  # its trial gets SIGTERM, saves and exits; the rerun waits for it
    process.wait()
    finished = {d.name for d in trials.glob("*") if results.trial_status(str(d))["status"] == "done"}
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
    workdir = tmp_path / "sw"
    rows = {r["trial"]: r for r in results.collect(str(workdir))}
    survivors = list(rows)
    for rung in (10, 20):  # the better half by eval/loss at each rung goes on, the others stop there
        at_rung = {t: results.metric_at(str(workdir / "trials" / t), "eval/loss", rung) for t in survivors}
        assert all(math.isfinite(v) for v in at_rung.values()), at_rung
        kept = sorted(survivors, key=at_rung.get)[:len(survivors) // 2]
        for t in survivors:
            if t in kept:
                assert rows[t]["steps"] > rung, (rung, at_rung)
            else:
                assert rows[t]["steps"] == rung and rows[t]["status"] == "stopped", (rung, at_rung)
                assert rows[t]["error"].startswith(f"stopped at step {rung}: eval/loss")
        survivors = kept
    assert [(rows[t]["steps"], rows[t]["status"]) for t in survivors] == [(30, "done")]


@pytest.mark.slow
def test_the_ray_backend_runs_the_same_sweep_on_a_local_ray_instance(tmp_path, local_sweep):
    local_workdir = local_sweep[0]
    experiment = write_experiment(tmp_path, 'sweep.grid({"optim.lr": [1e-3, 3e-3], "model.d_model": [32]})')
    on_ray = run_sweep(experiment, tmp_path / "ray", "--parallel", "2", "--backend", "ray")
    assert on_ray.returncode == 0, on_ray.stderr[-2000:]
    local = {r["trial"]: r for r in results.collect(str(local_workdir))}
    rows = {r["trial"]: r for r in results.collect(str(tmp_path / "ray"))}
    assert set(rows) == {"optim.lr=0.001,model.d_model=32", "optim.lr=0.003,model.d_model=32"}
    for trial, row in rows.items():
        assert row["status"] == "done"
        assert row["best eval/loss"] == pytest.approx(local[trial]["best eval/loss"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_trial_ends_with_the_process_that_started_it(tmp_path):
    """The sweep asks for its trials' end in the trial itself (cli.follow_parent), not between fork and exec."""
    child = ("import sys, time; from transformer import cli; cli.follow_parent(); "
             "open(sys.argv[1], 'w').close(); time.sleep(60)")
    parent = ("import os, subprocess, sys, time; from transformer import cli; "
              "p = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], "
              "env={**os.environ, cli.PARENT: str(os.getpid())}); print(p.pid, flush=True); time.sleep(60)")
    ready = tmp_path / "ready"
    process = subprocess.Popen([sys.executable, "-c", parent, child, str(ready)], cwd=REPO, stdout=subprocess.PIPE,
                               text=True)
    pid = int(process.stdout.readline())
    for _ in range(600):
        if ready.exists():
            break
        time.sleep(0.1)
    process.kill()
    process.wait()
    for _ in range(100):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # ended, not yet reaped by its new parent
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    pytest.fail("the trial outlived the process that started it")
