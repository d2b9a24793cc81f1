"""The GPU step's tools, checked on a CPU: memory before any step (a step larger than the device stops in
one line naming what to set; remat=auto takes the lightest policy that fits; the device's limit faked by
train.memory_limit_gb), progress lines off a terminal, and the profiler's window and kernel table."""

import os

import jax
import pytest

from test_train import launch, output
from transformer import profile
from transformer.training import loop, memory

SCANNED = ("model.scan_layers=true", "model.max_len=256", "data.seq_len=256", "model.num_layers=4")


def test_a_step_that_cannot_fit_stops_before_any_step_in_one_line(tmp_path):
    process = launch(tmp_path / "run", "train.memory_limit_gb=0.001", "train.steps=4")
    assert process.wait(timeout=300) == 2, output(tmp_path / "run")
    lines = output(tmp_path / "run").strip().splitlines()
    assert lines[-1].startswith("error: the train step does not fit in the device's 0.00 GiB (model.remat=none ")
    for key in ("model.remat=auto", "data.batch_size", "optim.accum_steps=2", "config.train.memory_limit_gb"):
        assert key in lines[-1]
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
    assert not os.listdir(tmp_path / "run" / "checkpoints") if os.path.exists(tmp_path / "run" / "checkpoints") \
        else True


def step_bytes(tmp_path, small_gpt_config, *overrides) -> tuple[str, int]:
    """(the remat policy the run chose, what its compiled step takes on a device)."""
    run = loop.setup(small_gpt_config(*SCANNED, *overrides), str(tmp_path))
    try:
        return run.model.remat, memory.needed(run.compiled_step)
    finally:
        run.ckpt.close()
        run.writer.close()


def test_remat_auto_takes_the_lightest_policy_that_fits(tmp_path, small_gpt_config):
    sizes = {policy: step_bytes(tmp_path / "fixed", small_gpt_config, f"model.remat={policy}")[1]
             for policy in memory.REMAT_ORDER}  # one workdir: another remat policy is the same model
    assert sizes["none"] > sizes["save_dots"] > sizes["full"], sizes
    between = lambda a, b: f"train.memory_limit_gb={(sizes[a] + sizes[b]) / 2 / memory.GiB}"
    for limit, want in ((between("none", "save_dots"), "save_dots"), (between("save_dots", "full"), "full"),
                        ("train.memory_limit_gb=100", "none")):
        policy, size = step_bytes(tmp_path / f"auto-{want}", small_gpt_config, "model.remat=auto", limit)
        assert (policy, size) == (want, sizes[want])
    with pytest.raises(memory.DoesNotFit, match=r"model.remat=full .* GiB\): set a smaller data.batch_size"):
        step_bytes(tmp_path / "none_fits", small_gpt_config, "model.remat=auto",
                   f"train.memory_limit_gb={sizes['full'] / 2 / memory.GiB}")


def test_off_a_terminal_progress_is_a_line_per_log_interval(tmp_path):
    """A SLURM job's log: whole lines, no carriage-return frames."""
    assert launch(tmp_path / "run", "train.steps=4", "train.log_every=2").wait(timeout=300) == 0
    log = output(tmp_path / "run")
    assert "\r" not in log
    assert "train: 2/4 (50%)" in log and "train: 4/4 (100%)" in log and "loss=" in log
    assert "memory: the train step takes" in log


def test_the_profiler_traces_the_chosen_steps_and_the_table_reads_them(tmp_path, small_gpt_config):
    loop.train(small_gpt_config("train.steps=7", "train.profile_start=3", "train.profile_steps=3"), str(tmp_path))
    trace = profile.latest_trace(str(tmp_path))
    assert os.path.exists(os.path.join(os.path.dirname(trace), "perfetto_trace.json.gz"))
    data = jax.profiler.ProfileData.from_file(trace)
    assert [s for s, _, _ in profile.step_windows(data)] == [3, 4, 5]
    rows, steady = profile.table(data, skip=1)
    assert steady == [4, 5]
    assert any(name.startswith(("dot", "ynn_fusion", "fusion")) for name in rows)
    lines = profile.report(trace, top=5)
    assert "steps 4..5 (steady)" in lines[0] and len(lines) == 2 + 5 + 1


def test_without_a_trace_the_table_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.profile_steps"):
        profile.latest_trace(str(tmp_path))
