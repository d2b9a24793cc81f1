"""Trackers (config.train.trackers): the names checked, a tracker that cannot start or fails said in one line while
the run goes on, and a tiny run with Weights & Biases offline and Trackio's local store logging its config and
metrics, read back through each library (skipped where it is not installed)."""

import glob
import importlib.util
import json
import os
import struct
import subprocess
import sys

import pytest
from test_sweep import TINY

from transformer.training import metrics as metrics_lib
from transformer.training import trackers


def test_trackers_are_parsed_and_an_unknown_one_is_refused():
    assert trackers.parse("tensorboard, wandb") == ["tensorboard", "wandb"]
    assert trackers.parse("(wandb,trackio)") == ["wandb", "trackio"]  # bracketed, as in a config file's arg
    assert trackers.parse("") == []
    with pytest.raises(ValueError, match="config.train.trackers='tensorbord': unknown tensorbord"):
        trackers.parse("tensorbord")


class Failing:
    def __init__(self):
        self.logged = 0

    def log(self, step, scalars, histograms):
        self.logged += 1
        raise ConnectionError("the server went away\nand more")

    def close(self):
        raise AssertionError("a dropped tracker is not closed")


def test_a_tracker_that_cannot_start_or_fails_is_said_in_one_line_and_the_run_goes_on(tmp_path, monkeypatch):
    from ml_collections import config_dict

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    config = config_dict.ConfigDict({"train": {"trackers": "wandb,tensorboard"}})
    said = []
    started = trackers.start(config, str(tmp_path), resumed=False, say=said.append)
    assert [type(t).__name__ for t in started] == ["TensorBoard"]
    assert said == ["config.train.trackers: wandb did not start (ModuleNotFoundError: import of wandb halted; None in "
                    "sys.modules); the run goes on without it"]
    failing = Failing()
    writer = metrics_lib.MetricWriter(str(tmp_path), trackers=[*started, failing], say=said.append)
    writer.write(5, {"train/loss": 2.0})
    writer.write(10, {"train/loss": 1.5})
    writer.close()
    assert failing.logged == 1 and said[-1] == ("config.train.trackers: failing failed (ConnectionError: the server "
                                                "went away); the run goes on without it")
    assert [r["step"] for r in metrics_lib.read(str(tmp_path / "metrics.jsonl"))] == [5, 10]
    assert glob.glob(str(tmp_path / "tb" / "events.*"))


INSTALLED = {name: importlib.util.find_spec(name) is not None for name in ("wandb", "trackio")}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """A tiny run (10 steps) with wandb offline and trackio's store in a temporary folder, as a user launches it."""
    names = [name for name, present in INSTALLED.items() if present]
    if not names:
        pytest.skip("neither wandb nor trackio is installed (pip install -e '.[trackers]')")
    root = tmp_path_factory.mktemp("tracked")
    workdir = root / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "TRACKIO_DIR": str(root / "trackio"),
           "PYTHONPATH": os.getcwd()}
    command = [sys.executable, "-m", "transformer.train", "--config", TINY + ",train.steps=10",
               f"--config.train.trackers=tensorboard,{','.join(names)}", "--config.train.tracker_group=test-sweep",
               "--workdir", str(workdir)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "did not start" not in done.stderr, done.stderr[-2000:]
    return workdir, root / "trackio", metrics_lib.read(str(workdir / "metrics.jsonl"))


def wandb_records(path: str) -> list:
    """The records of an offline run's .wandb file as wandb's own protobuf messages (the file is LevelDB's log
    format: 32 KiB blocks of records, each a 7-byte header (crc, length, kind) and its bytes; after a 7-byte
    W&B header)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, parts, out = open(path, "rb").read(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or a record's last part
            out.append(wandb_internal_pb2.Record.FromString(parts))
            parts = b""
    return out


@pytest.mark.skipif(not INSTALLED["wandb"], reason="wandb is not installed (pip install -e '.[trackers]')")
def test_wandb_offline_logs_the_config_and_every_metric(tracked_run):
    """Read back from the offline run's file with wandb's own messages (wandb.Api reads a run after `wandb sync`)."""
    workdir, _, records = tracked_run
    (path,) = glob.glob(str(workdir / "wandb" / "offline-run-*" / "run-*.wandb"))
    found = wandb_records(path)
    (run,) = [r.run for r in found if r.WhichOneof("record_type") == "run"]
    config = {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in run.config.update}
    assert run.run_group == "test-sweep" and run.display_name == "run" and run.project == "transformer"
    assert config["model"]["d_model"] == 32 and config["train"]["steps"] == 10
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in found
            if r.WhichOneof("record_type") == "history"]
    by_step = {row["_step"]: row for row in rows}
    for record in records:
        assert all(by_step[record["step"]][k] == pytest.approx(v) for k, v in record.items() if k != "step")


@pytest.mark.skipif(not INSTALLED["trackio"], reason="trackio is not installed (pip install -e '.[trackers]')")
def test_trackio_logs_the_config_and_every_metric_in_its_local_store(tracked_run, monkeypatch):
    _, store, records = tracked_run
    monkeypatch.setenv("TRACKIO_DIR", str(store))  # read when trackio is imported: the store of the run above
    from trackio import Api
    from trackio.sqlite_storage import SQLiteStorage

    (run,) = Api().runs("transformer")
    assert run.config["model"]["d_model"] == 32 and run.config["train"]["tracker_group"] == "test-sweep"
    logs = SQLiteStorage.get_logs("transformer", run.name, run_id=run.id)
    for record in records:  # each record the run wrote is one log of the store, at its step
        assert any(log["step"] == record["step"] and all(log.get(k) == pytest.approx(v) for k, v in record.items())
                   for log in logs), record
    assert SQLiteStorage.get_project_db_path("transformer").parent == store

def test_a_sweep_groups_its_trials_under_its_name(tmp_path):
    from transformer import config as config_lib
    from transformer.sweep import experiments, launch

    config = config_lib.load(TINY)
    experiment = experiments.Experiment("x.py", TINY, {"a": {"optim.lr": 0.1}}, 10, {"a": config})
    assert launch.group(experiment, "a", str(tmp_path / "lr_sweep")) == "lr_sweep"
    command = launch.trial_command(TINY, {"optim.lr": 0.1}, "dir", "lr_sweep")
    assert command[-2:] == ["--config.optim.lr=0.1", "--config.train.tracker_group=lr_sweep"]
    config.train.tracker_group = "mine"  # the experiment's own group stays
    assert launch.group(experiment, "a", str(tmp_path / "lr_sweep")) == ""
