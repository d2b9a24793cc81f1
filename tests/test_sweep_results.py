"""A sweep's records and reports: metrics files read and rewritten safely, the results table and plots over the
listed trials, a failing report, a workdir that holds another sweep."""

import csv
import json
import os

import pytest
from test_sweep import TINY

from transformer.sweep import experiments, launch, results
from transformer.training import metrics as metrics_lib


def make_trial(workdir, name, overrides, records, status="done", tail=""):
    directory = workdir / "trials" / name
    directory.mkdir(parents=True)
    record = {"status": status, **({"overrides": overrides} if overrides is not None else {})}
    (directory / "trial.json").write_text(json.dumps(record))
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_metrics_read_skips_a_torn_last_line_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 5, "train/loss": 2.0}\n{"step": 10, "train/lo')
    assert metrics_lib.read(str(path)) == [{"step": 5, "train/loss": 2.0}]
    path.write_text('{"step": 5, "train/lo\n{"step": 10, "train/loss": 1.0}\n')
    with pytest.raises(ValueError, match="metrics.jsonl, line 1: not a JSON record"):
        metrics_lib.read(str(path))


def test_truncate_after_replaces_the_file_so_a_reader_never_sees_it_half_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in (5, 10, 15)))
    with open(path) as reader:  # a sweep reading the file while the run resumes
        metrics_lib.truncate_after(str(path), 10)
        assert reader.read().count("step") == 3
    assert [r["step"] for r in metrics_lib.read(str(path))] == [5, 10]
    assert os.listdir(tmp_path) == ["metrics.jsonl"]


def test_the_report_covers_the_listed_trials_with_any_keys_pending_or_torn(tmp_path):
    workdir = tmp_path / "sw"
    make_trial(workdir, "optim.lr=0.001", {"optim.lr": 0.001}, [{"step": 10, "eval/loss": 2.5}])
    make_trial(workdir, "model.d_model=32", {"model.d_model": 32}, [{"step": 10, "eval/loss": 2.0}],
               tail='{"step": 20, "eval/lo')
    make_trial(workdir, "optim.lr=0.002", None, [], status="pending")
    make_trial(workdir, "optim.lr=0.1", {"optim.lr": 0.1}, [{"step": 10, "eval/loss": 1.0}])  # an old sweep's
    (workdir / "sweep.json").write_text(json.dumps(
        {"config": TINY, "metric": "eval/loss", "mode": "min",
         "trials": ["optim.lr=0.001", "model.d_model=32", "optim.lr=0.002"]}))
    rows = {r["trial"]: r for r in results.write(str(workdir))}
    assert set(rows) == {"optim.lr=0.001", "model.d_model=32", "optim.lr=0.002"}
    assert rows["model.d_model=32"]["steps"] == 10 and rows["optim.lr=0.002"]["status"] == "pending"
    assert results.swept_keys(list(rows.values())) == ["model.d_model", "optim.lr"]
    header = next(csv.reader(open(workdir / "results.csv")))
    assert header[:3] == ["trial", "model.d_model", "optim.lr"]
    assert "**model.d_model=32** (2)" in (workdir / "results.md").read_text()
    assert (workdir / "metric.png").stat().st_size > 1000


def test_a_failing_report_is_one_warning_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results, "write", lambda *args: {}["no such key"])
    assert launch.write_report(str(tmp_path), "eval/loss", "min") == []
    assert capsys.readouterr().err.strip().splitlines() == [
        f"warning: the results in {tmp_path} were not rewritten: KeyError: no such key"]


def test_a_workdir_refuses_a_sweep_of_another_config(tmp_path):
    experiment = experiments.Experiment("exp.py", TINY, {"optim.lr=0.001": {"optim.lr": 0.001}}, 20)
    experiments.write_settings(str(tmp_path), experiment, "eval/loss", "min")
    experiments.write_settings(str(tmp_path), experiment, "eval/accuracy", "max")
    assert results.read_settings(str(tmp_path))["trials"] == ["optim.lr=0.001"]
    with pytest.raises(ValueError, match="holds a sweep of .* give a new --workdir"):
        experiments.write_settings(str(tmp_path), experiments.Experiment("exp.py", TINY + ",train.steps=30", {}, 30),
                             "eval/loss", "min")
