"""The GPU step's tools, checked on a CPU: memory before any step (a step larger than the device stops in
one line naming what to set; remat=auto takes the lightest policy that fits; the device's limit faked by
train.memory_limit_gb), the logged norms kept out of the update's fusion, progress lines off a terminal,
the profiler's window and kernel table, and the GPU suite's machinery (experiments/bench/gpu_suite.py: its
refusal off a GPU, a row in its own process, the table beside GPU.md)."""

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import REPO, SMALL_GPT
from test_train import launch, output

from transformer.bench.census import census
from transformer.training import checks, loop, memory, profiler

SUITE = os.path.join(REPO, "experiments", "bench", "gpu_suite.py")
_spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
gpu_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_suite)

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
    run = loop.setup(checks.checked(small_gpt_config(*SCANNED, *overrides)), str(tmp_path))
    try:
        return run.model.remat, memory.needed(run.compiled_step)
    finally:
        run.ckpt.close()
        run.writer.close()


def test_remat_auto_takes_the_lightest_policy_that_fits(tmp_path, small_gpt_config):
    sizes = {policy: step_bytes(tmp_path / "fixed", small_gpt_config, f"model.remat={policy}")[1]
             for policy in memory.REMAT_ORDER}  # one workdir: another remat policy is the same model
    assert sizes["none"] > sizes["save_dots"] > sizes["full"], sizes
    limit = (sizes["save_dots"] + sizes["full"]) / 2 / memory.GiB
    assert step_bytes(tmp_path / "auto", small_gpt_config, "model.remat=auto",
                      f"train.memory_limit_gb={limit}") == ("full", sizes["full"])


def test_the_logged_norms_are_read_apart_from_the_update(tmp_path, small_gpt_config):
    run = loop.setup(checks.checked(small_gpt_config("optim.warmup_steps=0")), str(tmp_path))
    try:
        batch = run.place(run.task.train_batch(0))
        lowered = run.train_step.lower(run.state, batch, run.step_rng).as_text()
        old = jax.device_get(run.state.params)
        state, metrics = run.compiled_step(run.state, batch, run.step_rng)
    finally:
        run.ckpt.close()
        run.writer.close()
    new = jax.device_get(state.params)
    barrier = re.search(r"optimization_barrier ([^\n]*)", lowered)
    assert barrier and barrier.group(1).count("%") == 2 * len(jax.tree.leaves(new)), "params and updates"
    assert float(metrics["param_norm"]) == pytest.approx(float(optax.tree.norm(new)), rel=1e-6)
    update = optax.tree.norm(jax.tree.map(lambda a, b: a - b, new, old))
    assert float(metrics["update_norm"]) == pytest.approx(float(update), rel=1e-4)
    assert float(metrics["update_norm"]) > 0


def test_runs_on_an_accelerator_keep_their_compiled_programs_in_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TRANSFORMER_CACHE", str(tmp_path))
    session = jax.config.jax_compilation_cache_dir  # the tests' own (conftest)
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        loop.use_compile_cache("cpu")
        assert jax.config.jax_compilation_cache_dir is None
        loop.use_compile_cache("gpu")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
        loop.use_compile_cache("tpu")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "theirs")
    finally:
        jax.config.update("jax_compilation_cache_dir", session)


@pytest.mark.parametrize("limit, chosen", [(None, "none"), (3.5, "save_dots"), (2.5, "full"), (1.5, None)])
def test_the_choice_among_policies_by_their_compiled_sizes(limit, chosen):
    gib = {"none": 4, "save_dots": 3, "full": 2}
    compiled = {p: types.SimpleNamespace(memory_analysis=lambda g=g: types.SimpleNamespace(
        argument_size_in_bytes=g * memory.GiB, output_size_in_bytes=0, alias_size_in_bytes=0,
        temp_size_in_bytes=0, generated_code_size_in_bytes=0)) for p, g in gib.items()}
    limit = limit and int(limit * memory.GiB)
    if chosen is None:
        with pytest.raises(memory.DoesNotFit, match=r"\(model.remat=none 4.00 GiB, model.remat=save_dots 3.00 GiB, "
                                                    r"model.remat=full 2.00 GiB\): set a smaller data.batch_size"):
            memory.fitting(compiled.get, "auto", limit, 1)
    else:
        assert memory.fitting(compiled.get, "auto", limit, 1) == (chosen, compiled[chosen], gib[chosen] * memory.GiB)
    assert memory.fitting(compiled.get, "full", None, 1)[0] == "full"


def test_off_a_terminal_progress_is_a_line_per_log_interval(tmp_path):
    """A SLURM job's log: whole lines, no carriage-return frames."""
    assert launch(tmp_path / "run", "train.steps=4", "train.log_every=2").wait(timeout=300) == 0
    log = output(tmp_path / "run")
    assert "\r" not in log
    assert "train: 2/4 (50%)" in log and "train: 4/4 (100%)" in log and "loss=" in log
    assert "memory: the train step takes" in log


def test_the_profiler_traces_the_chosen_steps_and_the_table_reads_them(tmp_path, small_gpt_config):
    loop.train(small_gpt_config("train.steps=7", "train.profile_start=3", "train.profile_steps=3"), str(tmp_path))
    trace = profiler.latest_trace(str(tmp_path))
    assert os.path.exists(os.path.join(os.path.dirname(trace), "perfetto_trace.json.gz"))
    data = jax.profiler.ProfileData.from_file(trace)
    assert [s for s, _, _ in profiler.step_windows(data)] == [3, 4, 5]
    rows, steady = profiler.table(data, skip=1)
    assert steady == [4, 5]
    assert any(name.startswith(("dot", "ynn_fusion", "fusion")) for name in rows)
    lines = profiler.report(trace, top=5)
    assert "steps 4..5 (steady)" in lines[0] and len(lines) == 2 + 5 + 1


def test_the_census_counts_what_a_program_launches_loop_bodies_and_branches_included():
    def f(x):
        def body(c, _):
            return jnp.sin(c) @ c.T + jax.lax.cond(c.sum() > 0, lambda: c * 2, lambda: jnp.cos(c)), None
        return jax.lax.scan(body, x, None, length=4)[0]

    ops = census(jax.jit(f).lower(jnp.ones((64, 64))).compile().as_text())
    assert ops["while"] == 1 and ops["conditional"] == 1, ops
    top = census(jax.jit(lambda x: x + 1).lower(jnp.ones(4)).compile().as_text())
    assert sum(ops.values()) > sum(top.values()) + 3, (ops, top)  # the body's and the branches' ops


def test_without_a_trace_the_table_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.profile_steps"):
        profiler.latest_trace(str(tmp_path))


def test_the_gpu_suite_refuses_a_machine_without_a_gpu_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, SUITE], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: the GPU suite measures an NVIDIA GPU, and this machine computes on cpu (cpu)"]


def test_a_suite_row_runs_in_its_own_process_and_reads_its_json(tmp_path):
    """The suite's machinery on CPU: a bench row's process, its JSON, its line; a failing row is a cell."""
    row = gpu_suite.Row("tiny", "GPT tiny", "bench", ("--config", ",".join(["configs/gpt.py:tiny", *SMALL_GPT]),
                                                      "--steps", "2", "--warmup", "1"), gpu_suite._runs, "runs")
    result = gpu_suite.run_row(row, str(tmp_path))
    text, met = row.read(result, {})
    assert met and re.match(r"[\d,.k]+/s, [\d.]+ ms, compile \d+ s$", text), text  # no MFU: no CPU datasheet
    broken = dataclasses.replace(row, args=("--config", "configs/gpt.py:tiny,model.d_model=102"))
    assert "config.model.d_model=102 is not divisible" in gpu_suite.run_row(broken, str(tmp_path))["error"]


def test_the_suites_decode_row_runs_the_engines_benchmark_script(tmp_path):
    row = next(r for r in gpu_suite.ROWS if r.key == "decode")
    small = dataclasses.replace(row, args=(row.args[0], "--layers", "1", "--batches", "1,2", "--new", "4",
                                           "--rounds", "1", "--peer", "0", "--serve", "0"))
    text, met = small.read(gpu_suite.run_row(small, str(tmp_path)), {})
    assert re.fullmatch(r"batch 1: [\d,]+ tok/s, MBU \d+%; batch 2: [\d,]+ tok/s, MBU \d+%", text), text
    assert met in (True, False)


def test_the_suite_prints_each_row_beside_the_committed_table(tmp_path):
    record = tmp_path / "GPU.md"
    shutil.copy(gpu_suite.RECORD, record)
    before = gpu_suite.committed(str(record))
    assert set(before) == {row.key for row in gpu_suite.ROWS}  # every row has its last result
    assert before["gpt2-small"].startswith("162k/s, 100.9 ms, MFU 14.0%, 0.57x")
    train = {"train": {"items_per_s": 300e3, "step_s": 0.0546, "mfu": 0.25, "compile_s": 30.0, "peer": "torch",
                       "ratio": 1.25}}
    text, met = gpu_suite.ROWS[1].read(train, {})
    assert (text, met) == ("300.0k/s, 54.6 ms, MFU 25.0%, 1.25x the torch peer, compile 30 s", True)
    docs = {"train": {**train["train"], "items_per_s": 250e3}}
    assert gpu_suite.ROWS[2].read(docs, {"gpt2-small": train})[1] is False  # 0.83x the plain run's
    table = gpu_suite.format_table([(gpu_suite.ROWS[1], text, met)], before)
    assert f"| gpt2-small | {text} | {before['gpt2-small']} | >= 1.2x the peer | yes |" in table
    attention = [{"length": 2048, "mask": "causal", "implementation": "auto", "ms": 0.5},
                 {"length": 2048, "mask": "causal", "implementation": "cudnn", "ms": 0.45}]
    assert gpu_suite._attention(attention, {})[1] is True  # 1.11x


def test_the_suite_keeps_to_its_budget_and_records_after_every_row(tmp_path, monkeypatch):
    """A row is not started with under MIN_ROW_S of --budget_s left; the table is rewritten after each row,
    so a device call cut short still leaves the rows it measured (and their raw results as JSON)."""
    broken = gpu_suite.Row("broken", "a config error", "bench", ("--config", "configs/gpt.py:tiny,model.d_model=102"),
                           gpu_suite._runs, "runs")
    late = [dataclasses.replace(broken, key=key) for key in ("late", "later")]
    ticks = iter([0.0, 0.0, 20.0, 100 - gpu_suite.MIN_ROW_S + 1, 60.0, 60.0, 60.0])  # start, then each row's two
    written = []
    monkeypatch.setattr(gpu_suite, "write_record", lambda table, *a, partial: written.append((table, partial)))
    lines = gpu_suite.measure([broken, *late], str(tmp_path), 100.0, str(tmp_path / "GPU.md"), "fake",
                              lambda: next(ticks))
    assert [text.split(":")[0] for _, text, _ in lines] == ["failed", "not run", "not run"]
    assert "not divisible" in lines[0][1] and "100 s of the suite's budget (--budget_s)" in lines[1][1]
    assert [partial for _, partial in written] == [True, True, False]
    assert written[0][0].count("\n| ") == 2 and "| later | a config error | not run" in written[-1][0]


def test_the_record_names_the_commit_the_tree_travelled_with(tmp_path, monkeypatch):
    monkeypatch.setenv("SUITE_COMMIT", "abc1234")
    record = tmp_path / "GPU.md"
    gpu_suite.write_record("| row |", "NVIDIA H200", str(record), {"gpt2-small": {"error": "x"}}, partial=True)
    text = record.read_text()
    assert "on NVIDIA H200" in text and "at abc1234, jax" in text and "still running" in text
    assert (tmp_path / "GPU.json").read_text().count('"error": "x"') == 1
