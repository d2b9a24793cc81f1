"""Faults a run meets and survives: a corpus without an eval split, divergence, two launches, a corrupt
checkpoint, a full disk, a failed first launch, and OS and encoding errors, each ending in one line."""

import errno
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import FAST_COMPILES, REPO, SMALL_GPT

from transformer import checkpoints, cli, rundir
from transformer import config as config_lib
from transformer.data.text import labelled, lm_streams, seq2seq_pairs, token_store
from transformer.training import checks, divergence, evaluation, loop, shapes
from transformer.training import metrics as metrics_lib


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """One text file (one document: a hash split gives it no eval split), ~40K byte tokens."""
    path = tmp_path_factory.mktemp("text") / "one.txt"
    path.write_text(open(os.path.join(sysconfig.get_paths()["stdlib"], "os.py")).read())
    return str(path)


@pytest.fixture
def config(small_gpt_config, text_file):
    return lambda *overrides: small_gpt_config(f"data.source={text_file}", "train.sample_tokens=0", *overrides)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text_file):
    """A finished six-step run on the text file (checkpoints 3 and 6), copied by the tests that break it."""
    workdir = str(tmp_path_factory.mktemp("trained") / "run")
    made = shapes.resolved(config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny"),
                                           [*SMALL_GPT, f"data.source={text_file}", "train.sample_tokens=0"]))
    train(made, workdir)
    return workdir


def train(config, workdir: str) -> dict:
    """loop.train on one device (a cheaper compile than the eight the tests have)."""
    return loop.train(config, workdir, jax.devices()[:1])


def copy_of(trained, tmp_path) -> str:
    return shutil.copytree(trained, str(tmp_path / "run"))


def losses(workdir, key="eval/loss"):
    return {r["step"]: r[key] for r in metrics_lib.read(os.path.join(workdir, "metrics.jsonl")) if key in r}


def test_a_single_text_file_holds_out_the_end_of_its_tokens_for_eval(trained):
    assert sorted(losses(trained)) == [3, 6]
    assert sorted(os.listdir(os.path.join(trained, "checkpoints"))) == ["3", "6"]
    store = token_store.Store.open(os.path.join(trained, "store"))
    whole = store.split("train")
    source = lm_streams.Source("store", store, 17, 16, 800)
    assert (len(source.train), len(source.held)) == (len(whole) - 800, 800)
    np.testing.assert_array_equal(source.held.read(0, 50), whole.read(len(whole) - 800, len(whole) - 750))
    assert source.windows == (len(whole) - 800 - 17) // 16 + 1  # no train window reads a held-out token


def test_too_few_tokens_for_an_eval_batch_stop_before_any_step(tmp_path, config):
    (tmp_path / "small.txt").write_text("a few words " * 20)
    with pytest.raises(ValueError, match="too few to hold one out.*config.data.eval_batches=0"):
        train(config(f"data.source={tmp_path / 'small.txt'}"), str(tmp_path / "run"))
    assert not glob.glob(str(tmp_path / "run" / "checkpoints" / "*"))


def test_an_eval_that_fails_keeps_the_checkpoint_of_its_step(tmp_path, config, monkeypatch):
    def broken(*_):
        raise RuntimeError("eval broke")
    monkeypatch.setattr(loop, "evaluate", broken)
    with pytest.raises(RuntimeError, match="eval broke"):
        train(config(), str(tmp_path / "run"))
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["3"]


@pytest.mark.slow
def test_no_checkpoint_of_non_finite_parameters(tmp_path, config):
    diverging = config("optim.lr=1e6", "optim.warmup_steps=0", "train.steps=20", "train.checkpoint_every=1",
                       "train.log_every=10", "train.eval_every=20")
    with pytest.raises(divergence.NonFiniteLoss, match="non-finite .*param_norm at step") as raised:
        train(diverging, str(tmp_path / "run"))
    run = rundir.open(str(tmp_path / "run"))
    assert run.steps, "it diverged before its first checkpoint"
    kept = ", ".join(rf"{s}( \(loss [^)]*\))?" for s in run.steps)  # each kept one, with its loss where logged
    assert re.search(f"stopped without saving: (.*; )?kept checkpoints: {kept}; ", str(raised.value))
    for step in run.steps:
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(run.restore_params(step)))


@pytest.mark.slow
def test_resume_skips_a_non_finite_checkpoint(trained, tmp_path, config, capfd):
    workdir = copy_of(trained, tmp_path)
    run = loop.setup(checks.checked(config("train.steps=7")), workdir, jax.devices()[:1])
    poisoned = run.state.replace(step=run.state.step + 1, params=jax.tree.map(lambda x: x * np.nan, run.state.params))
    run.ckpt.manager.save(7, args=ocp.args.Composite(params=ocp.args.StandardSave(poisoned.params),
                                                    opt_state=ocp.args.StandardSave(poisoned.opt_state)), force=True)
    run.ckpt.wait()
    run.ckpt.close()
    capfd.readouterr()
    last = train(config("train.steps=7"), workdir)
    assert np.isfinite(last["train/loss"])
    assert "checkpoint 7 skipped: its parameters are not finite" in capfd.readouterr().err
    assert os.listdir(os.path.join(workdir, "checkpoints.skipped")) == ["7"]
    assert rundir.open(workdir).steps == [3, 6, 7]


def truncate(workdir, step):
    """Cuts the largest file of checkpoint `step`'s params in half."""
    files = glob.glob(os.path.join(workdir, "checkpoints", str(step), "params", "**", "*"), recursive=True)
    largest = max((f for f in files if os.path.isfile(f)), key=os.path.getsize)
    os.truncate(largest, os.path.getsize(largest) // 2)


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one(trained, tmp_path, config, capfd):
    workdir = copy_of(trained, tmp_path)
    truncate(workdir, 6)
    step, metrics = evaluation.evaluate_run(workdir, record=False)
    assert step == 3 and metrics["eval/loss"] == pytest.approx(losses(trained)[3], rel=1e-5)
    assert "checkpoint 6 skipped: it does not read whole" in capfd.readouterr().err
    train(config(), workdir)  # resumes at 3, steps 4-6 again, and ends as the run did
    assert losses(workdir)[6] == pytest.approx(losses(trained)[6], rel=1e-5)
    assert os.listdir(os.path.join(workdir, "checkpoints.skipped")) == ["6"]


def test_a_relaunch_resumes_from_an_earlier_kept_checkpoint(trained, tmp_path, config, capfd):
    workdir = copy_of(trained, tmp_path)
    with pytest.raises(ValueError, match="--resume_step=4: .* keeps the checkpoints of steps 3, 6: choose one"):
        loop.train(config(), workdir, jax.devices()[:1], resume_step=4)
    loop.train(config(), workdir, jax.devices()[:1], resume_step=3)
    assert "checkpoint 6 moved to" in capfd.readouterr().err
    assert os.listdir(os.path.join(workdir, "checkpoints.skipped")) == ["6"]
    assert losses(workdir, "train/loss") == pytest.approx(losses(trained, "train/loss"), rel=1e-5)


def test_a_loss_spike_is_where_the_divergence_began_and_the_advice_points_before_it(tmp_path):
    def logged(values):
        with open(tmp_path / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps({"step": 10 * (i + 1), "train/loss": v}) + "\n" for i, v in enumerate(values))
    steady = [3.0 - 0.1 * i + 0.02 * (-1) ** i for i in range(8)]  # steps 10-80, falling from 3.0 to ~2.3
    logged([*steady, 9.0, 14.0, 30.0])  # a spike at step 90 that never comes back
    assert divergence.spike_start(divergence.losses(str(tmp_path)))[0] == 90
    said = divergence.advice(str(tmp_path), [40, 80, 100])
    assert said.startswith("the loss spiked at step 90 (9 against a running mean of 2.6")
    assert f"kept checkpoints: 40 (loss {steady[3]:.4g}), 80 (loss {steady[7]:.4g}), 100 (loss 14)" in said
    assert f"relaunch from step 80 with a lower config.optim.lr (python -m transformer.train --workdir {tmp_path} " \
           "--resume_step 80)" in said
    assert "no kept checkpoint precedes it" in divergence.advice(str(tmp_path), [90, 100])
    logged([*steady, 9.0, 2.2, 2.1])  # a spike the loss came back from: no divergence under way
    assert divergence.spike_start(divergence.losses(str(tmp_path))) is None
    assert divergence.advice(str(tmp_path), [40, 110]).startswith("kept checkpoints: 40 (loss")
    assert "relaunch from step 110" in divergence.advice(str(tmp_path), [40, 110])
    assert "--resume_step" not in divergence.advice(str(tmp_path), [40, 110])  # the latest: a plain relaunch


def test_an_empty_manifest_falls_back_and_none_whole_names_the_checkpoint(trained, tmp_path):
    workdir = copy_of(trained, tmp_path)
    open(os.path.join(workdir, "checkpoints", "6", "params", "manifest.ocdbt"), "w").close()
    assert evaluation.evaluate_run(workdir, record=False)[0] == 3
    truncate(workdir, 3)
    with pytest.raises(ValueError, match=r"checkpoints/6: it does not read whole.*remove it") as e:
        evaluation.evaluate_run(workdir, record=False)
    assert "\n" not in cli.one_line(e.value)


def test_a_full_disk_stops_at_the_save_naming_the_path_and_the_space(tmp_path, config, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    with pytest.raises(checkpoints.SaveFailed) as e:
        train(config(), str(tmp_path / "run"))
    line = cli.one_line(e.value)
    assert f"saving checkpoint 3 to {tmp_path / 'run' / 'checkpoints' / '3'} failed: the disk is full" in line
    assert "MB, 0.0 MB are free there" in line
    assert os.listdir(tmp_path / "run" / "checkpoints") == []


def test_a_save_that_fails_midway_leaves_no_temporary_files(tmp_path, config, monkeypatch):
    def enospc(self, step, *args, **kwargs):  # as TensorStore fails a write on a full disk
        partial = os.path.join(str(self.directory), f"{step}.orbax-checkpoint-tmp-1234")
        os.makedirs(os.path.join(partial, "params"))
        raise ValueError(f"RESOURCE_EXHAUSTED: Failed writing {partial}: No space left on device "
                         f"[os_error_code='{errno.ENOSPC}']")
    monkeypatch.setattr(ocp.CheckpointManager, "save", enospc)
    with pytest.raises(checkpoints.SaveFailed, match="saving checkpoint 3 .* failed: the disk is full"):
        train(config(), str(tmp_path / "run"))
    assert os.listdir(tmp_path / "run" / "checkpoints") == []


def test_opening_the_checkpoints_waits_for_the_removal_of_a_killed_saves_folders(tmp_path, monkeypatch):
    """orbax removes a killed save's temporary folders in a thread of its own: the checkpointer returns once they
    are gone, so a launch that fails right after never exits under that thread (its traceback after the error)."""
    import asyncio

    from orbax.checkpoint._src.path import temporary_paths
    real = temporary_paths.cleanup_temporary_paths

    async def slow(*args, **kwargs):
        await asyncio.sleep(0.5)
        return await real(*args, **kwargs)
    monkeypatch.setattr(temporary_paths, "cleanup_temporary_paths", slow)
    partial = tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1234"
    (partial / "params").mkdir(parents=True)
    checkpoints.Checkpointer(str(tmp_path / "checkpoints")).close()
    assert not partial.exists()


def test_a_background_save_that_ends_uncommitted_stops_the_next_step(tmp_path, config, monkeypatch):
    def unfinished(self, step, *args, **kwargs):  # a save whose background write failed after it began
        os.makedirs(os.path.join(str(self.directory), f"{step}.orbax-checkpoint-tmp-1234", "params"))
        return True
    monkeypatch.setattr(ocp.CheckpointManager, "save", unfinished)
    with pytest.raises(checkpoints.SaveFailed, match="saving checkpoint 3 .* failed: it was not committed"):
        train(config(), str(tmp_path / "run"))
    assert os.listdir(tmp_path / "run" / "checkpoints") == []
    assert max(losses(str(tmp_path / "run"), "train/loss")) == 3  # stopped in the step after the save


def train_command(workdir, *overrides):
    flags = [f"--config.{o}" for o in (*SMALL_GPT, "train.sample_tokens=0", *overrides)]
    return [sys.executable, "-m", "transformer.train", "--config", "configs/gpt.py:tiny", "--workdir", str(workdir),
            *flags]


@pytest.mark.slow
def test_a_second_launch_on_a_held_workdir_fails_in_one_line(tmp_path, text_file):
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILES}
    first = subprocess.Popen(train_command(tmp_path / "run", f"data.source={text_file}", "train.steps=100000",
                                           "train.checkpoint_every=100000", "train.eval_every=100000"),
                             cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        start = time.monotonic()
        while not os.path.exists(tmp_path / "run" / "metrics.jsonl"):
            assert first.poll() is None and time.monotonic() - start < 120, first.stderr.read()
            time.sleep(0.05)
        second = subprocess.run(train_command(tmp_path / "run", f"data.source={text_file}"), cwd=REPO, env=env,
                                capture_output=True, text=True)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [
            f"error: {tmp_path / 'run'} is in use by a run that is still training or saving (process {first.pid} "
            f"on {os.uname().nodename}, holding {tmp_path / 'run' / '.lock'}): wait for it to end, or stop it"]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    rundir.hold(str(tmp_path / "run")).close()  # a dead process holds nothing


def test_a_failed_first_launch_accepts_the_corrected_command(tmp_path, config, text_file):
    (tmp_path / "empty.txt").write_text("")
    workdir = str(tmp_path / "run")
    with pytest.raises(ValueError):
        train(config(f"data.source={tmp_path / 'empty.txt'}"), workdir)
    with pytest.raises(FileNotFoundError, match="no files match"):
        train(config(f"data.source={tmp_path / 'missing*.txt'}", "model.num_layers=1"), workdir)
    assert not os.path.exists(os.path.join(workdir, rundir.CONFIG))
    train(config("train.steps=3", "model.num_layers=1"), workdir)
    saved = open(os.path.join(workdir, rundir.CONFIG)).read()
    with pytest.raises(ValueError, match="was tokenized with"):
        train(config(f"data.source={tmp_path / 'empty.txt'}", "model.num_layers=1"), workdir)
    assert open(os.path.join(workdir, rundir.CONFIG)).read() == saved


def test_os_and_encoding_errors_name_what_failed_and_where(tmp_path):
    assert cli.one_line(OSError(errno.ENOSPC, "No space left on device", "/data/x")) == \
        "No space left on device: /data/x"
    with pytest.raises(OSError) as e:
        rundir.hold("/proc/x/run")
    assert cli.one_line(e.value) == "cannot create the workdir /proc/x/run: No such file or directory"
    (tmp_path / "bad.tsv").write_bytes(b"pos\tgood\nneg\tba\xffd\n")
    for read in (labelled.read_labelled, seq2seq_pairs.read_pairs):
        with pytest.raises(ValueError) as e:
            read(str(tmp_path / "bad.tsv"))
        assert cli.one_line(e.value) == f"{tmp_path / 'bad.tsv'}:2: not UTF-8 (byte 0xff at column 7): save the file " \
                                        "as UTF-8"
    with pytest.raises(UnicodeDecodeError) as e:
        b"\xff".decode("utf-8")
    assert cli.one_line(e.value).startswith("'utf-8' codec can't decode byte 0xff")


def test_a_sweep_trial_holds_the_lock_its_sweep_hands_it(tmp_path):
    from transformer.sweep import launch
    hold = [sys.executable, "-c", "import sys; from transformer import rundir; rundir.hold(sys.argv[1]); print('held')",
            str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": REPO}
    held_here = launch.lock_trial(str(tmp_path), blocking=False)
    try:
        other = subprocess.run(hold, env=env, capture_output=True, text=True)
        assert other.returncode != 0 and "is in use by a run" in other.stderr
    finally:
        os.close(held_here)
    trial = launch.start_process(hold, str(tmp_path), env)  # the lock passes to the trial's process
    assert trial.wait() == 0 and "held" in open(tmp_path / "trial.log").read()
