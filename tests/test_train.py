"""Training runs end to end: the run directory, 1 vs 8 devices, resume, interruption, NaN stop."""

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time

import jax
import numpy as np
import pytest
from conftest import FAST_COMPILES, REPO, SMALL_GPT

from transformer import parallel, rundir
from transformer.training import checks, divergence, loop
from transformer.training import metrics as metrics_lib


def records(workdir, key):
    return {r["step"]: r[key] for r in metrics_lib.read(os.path.join(workdir, "metrics.jsonl")) if key in r}


def launch(workdir, *overrides):
    """Starts `python -m transformer.train` on the small GPT in a subprocess with one CPU device."""
    flags = [f"--config.{o}" for o in (*SMALL_GPT, *overrides)]
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILES}
    log = open(f"{workdir}.log", "a")
    return subprocess.Popen([sys.executable, "-m", "transformer.train", "--config", "configs/gpt.py:tiny",
                             "--workdir", str(workdir), *flags], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT, text=True)


def output(workdir) -> str:
    with open(f"{workdir}.log") as f:
        return f.read()[-3000:]


def test_run_directory_holds_config_metrics_events_and_checkpoints(tmp_path, small_gpt_config):
    last = loop.train(small_gpt_config(), str(tmp_path))
    assert json.load(open(tmp_path / "config.json"))["model"]["d_model"] == 32
    recs = metrics_lib.read(str(tmp_path / "metrics.jsonl"))
    train_keys = {"train/loss", "train/grad_norm", "train/param_norm", "train/update_norm", "train/lr",
                  "train/tokens_per_s"}
    assert train_keys <= set(recs[0])
    assert [r["step"] for r in recs if "eval/loss" in r] == [3, 6]
    assert {"eval/bits_per_byte", "eval/perplexity"} <= set(recs[-1])
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "6"]
    assert any(f.startswith("events") for f in os.listdir(tmp_path / "tb"))
    assert (tmp_path / "tokenizer_config.json").exists()
    losses = records(str(tmp_path), "train/loss")
    assert losses[6] < losses[1] and last["eval/loss"] < np.log(256)
    restored = loop.setup(checks.checked(small_gpt_config()), str(tmp_path))
    assert int(restored.state.step) == 6
    np.testing.assert_allclose(loop.evaluate(restored, restored.state.params)["eval/loss"],
                               recs[-1]["eval/loss"], rtol=1e-6)
    run = rundir.open(str(tmp_path))
    assert run.latest_step == 6 and run.config.model.d_model == 32 and run.tokenizer().vocab_size == 256
    assert [s["path"] for s in run.data_record["stores"]] == [str(tmp_path / "store")]
    fsdp = parallel.make_mesh(small_gpt_config("mesh.data=1", "mesh.fsdp=-1").mesh)  # 8-way, unlike training's
    embedding = run.restore_params(mesh=fsdp)["embed"]["embedding"]
    assert embedding.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    np.testing.assert_array_equal(embedding, restored.state.params["embed"]["embedding"])
    with pytest.raises(FileNotFoundError, match="is --workdir a run directory"):
        rundir.open(str(tmp_path / "tb"))


def test_one_device_and_eight_devices_give_the_same_losses(tmp_path, small_gpt_config):
    assert len(jax.devices()) == 8
    config = small_gpt_config("train.steps=3")
    loop.train(config, str(tmp_path / "one"), devices=jax.devices()[:1])
    loop.train(config, str(tmp_path / "eight"))
    one, eight = records(str(tmp_path / "one"), "train/loss"), records(str(tmp_path / "eight"), "train/loss")
    assert len(one) == 3
    np.testing.assert_allclose([eight[s] for s in one], list(one.values()), rtol=1e-5)


def test_stop_at_pauses_without_changing_the_schedule(tmp_path, small_gpt_config):
    loop.train(small_gpt_config(), str(tmp_path / "whole"))
    loop.train(small_gpt_config("train.stop_at=4"), str(tmp_path / "paused"))
    assert max(records(str(tmp_path / "paused"), "train/loss")) == 4
    assert 4 in records(str(tmp_path / "paused"), "eval/loss")
    loop.train(small_gpt_config(), str(tmp_path / "paused"))
    whole, paused = records(str(tmp_path / "whole"), "train/loss"), records(str(tmp_path / "paused"), "train/loss")
    np.testing.assert_allclose([paused[s] for s in sorted(whole)], [whole[s] for s in sorted(whole)], rtol=1e-5)


def test_relaunch_resumes_and_finishes_where_it_left_off(tmp_path, small_gpt_config):
    loop.train(small_gpt_config("train.steps=3"), str(tmp_path / "run"))
    loop.train(small_gpt_config(), str(tmp_path / "run"))
    loop.train(small_gpt_config(), str(tmp_path / "straight"))
    resumed, straight = records(str(tmp_path / "run"), "train/loss"), records(str(tmp_path / "straight"), "train/loss")
    assert sorted(resumed) == sorted(straight) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(list(resumed.values()), list(straight.values()), rtol=1e-6)


def test_a_workdir_of_another_model_is_refused(tmp_path, small_gpt_config):
    loop.train(small_gpt_config("train.steps=1"), str(tmp_path))
    with pytest.raises(ValueError, match="another model"):
        loop.train(small_gpt_config("model.d_model=64"), str(tmp_path))


def test_a_run_saved_before_a_model_key_existed_resumes(tmp_path, small_gpt_config):
    import json
    loop.train(small_gpt_config("train.steps=1"), str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["model"] = {k: v for k, v in saved["model"].items()
                      if not k.startswith("rope") and k not in ("qkv_bias", "qk_norm", "logit_softcap")}
    (tmp_path / "config.json").write_text(json.dumps(saved))  # as written before those keys were added
    assert loop.train(small_gpt_config("train.steps=2"), str(tmp_path))["train/loss"] > 0
    with pytest.raises(ValueError, match="another model"):
        loop.train(small_gpt_config("train.steps=3", "model.rope_theta=500.0"), str(tmp_path))


def test_non_finite_loss_stops_with_the_last_good_checkpoint(tmp_path, small_gpt_config):
    config = small_gpt_config("optim.lr=1e12", "optim.warmup_steps=0", "train.steps=30",
                              "train.checkpoint_every=1")
    with pytest.raises(divergence.NonFiniteLoss, match="non-finite"):
        loop.train(config, str(tmp_path))
    saved = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints"))
    assert saved and max(saved) < 30


def wait_for(workdir, name, proc, timeout=120.0):
    """Waits until workdir/name exists while `proc` (training in workdir) runs."""
    path, start = workdir / name, time.monotonic()
    while not os.path.exists(path):
        assert proc.poll() is None, output(workdir)
        assert time.monotonic() - start < timeout, f"{path} never appeared"
        time.sleep(0.02)


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_relaunch_ends_like_an_uninterrupted_run(tmp_path):
    run = ("train.steps=400", "train.checkpoint_every=20", "train.log_every=20", "train.eval_every=400")
    straight = launch(tmp_path / "straight", *run)
    assert straight.wait() == 0, output(tmp_path / "straight")
    killed = launch(tmp_path / "killed", *run)
    wait_for(tmp_path / "killed", "checkpoints/20", killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    saved = max(int(s) for s in os.listdir(tmp_path / "killed" / "checkpoints") if s.isdigit())
    assert saved < 400, "the run finished before it was killed"
    relaunched = launch(tmp_path / "killed", *run)
    assert relaunched.wait() == 0, output(tmp_path / "killed")
    for key in ("train/loss", "eval/loss"):
        a, b = records(str(tmp_path / "straight"), key), records(str(tmp_path / "killed"), key)
        assert a.keys() == b.keys()
        np.testing.assert_allclose(b[400], a[400], rtol=1e-6)


@pytest.mark.slow
def test_sigint_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    proc = launch(tmp_path / "run", "train.steps=100000", "train.checkpoint_every=50000", "train.log_every=10")
    wait_for(tmp_path / "run", "metrics.jsonl", proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, output(tmp_path / "run")
    assert "SIGINT: saved a checkpoint" in output(tmp_path / "run")
    assert len(os.listdir(tmp_path / "run" / "checkpoints")) == 1


@pytest.mark.slow
def test_generate_cli_continues_the_prompt(tmp_path):
    assert launch(tmp_path / "run", "train.steps=3").wait() == 0, output(tmp_path / "run")
    out = subprocess.run([sys.executable, "-m", "transformer.generate", "--workdir", str(tmp_path / "run"),
                          "--prompt", "def ", "--max_new_tokens", "10", "--temperature", "0"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("def ") and len(out.stdout.encode()) >= 5


@pytest.mark.parametrize("args,message", [
    (["--config", "configs/gpt.py:tiny", "--config.optim.lrr=1"], "key optim.lrr; did you mean optim.lr?"),
    (["--config", "configs/gpt.py:tiny,optim.lrr=1"], "unknown config key optim.lrr; did you mean optim.lr"),
    (["--config", "configs/gpt.py:huge"], "unknown gpt preset 'huge'"),
    (["--config", "configs/nope.py"], "No such file or directory: 'configs/nope.py'"),
    (["--config", "configs/gpt.py:tiny", "--config.model.d_model=102"],
     "config.model.d_model=102 is not divisible by num_heads=4"),
])
def test_config_mistakes_fail_in_one_line_naming_the_key(tmp_path, args, message):
    out = subprocess.run([sys.executable, "-m", "transformer.train", *args, "--workdir", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_init_from_loads_the_shared_weights_and_keeps_new_ones(tmp_path, small_gpt_config):
    loop.train(small_gpt_config("train.steps=2"), str(tmp_path / "pre"))
    pretrained = rundir.open(str(tmp_path / "pre")).restore_params()
    run = loop.setup(checks.checked(small_gpt_config(f"init_from={tmp_path / 'pre'}", "train.steps=1")),
                     str(tmp_path / "ft"))
    np.testing.assert_array_equal(run.state.params["block_1"]["mlp"]["up"]["kernel"],
                                  pretrained["block_1"]["mlp"]["up"]["kernel"])
    assert int(run.state.step) == 0
    with pytest.raises(ValueError, match="embed/embedding is"):
        config = small_gpt_config(f"init_from={tmp_path / 'pre'}", "model.vocab_size=300")
        loop.setup(checks.checked(config), str(tmp_path / "x"))


def test_a_bpe_tokenizer_is_trained_into_the_runs_store_and_reused(tmp_path, small_gpt_config):
    bpe = ("data.tokenizer=bpe", "data.vocab_size=300", "model.vocab_size=300",
           f"data.source={sysconfig.get_paths()['stdlib']}/email/*.py")  # 0.4 MB: the whole stdlib takes a minute
    config = small_gpt_config(*bpe, "train.steps=2")
    loop.train(config, str(tmp_path))
    assert json.load(open(tmp_path / "tokenizer_config.json"))["kind"] == "bpe"
    index = json.load(open(tmp_path / "store" / "index.json"))
    assert index["tokenizer"]["kind"] == "bpe" and index["dtype"] == "uint16"
    assert index["tokenizer"]["trained_on"]["bytes"] > 0  # a bounded sample, stated in the index
    before = os.path.getmtime(tmp_path / "store" / "index.json")
    loop.train(small_gpt_config(*bpe, "train.steps=3"), str(tmp_path))  # resumed: the same store, not rebuilt
    assert os.path.getmtime(tmp_path / "store" / "index.json") == before
    nats_per_byte = records(str(tmp_path), "eval/bits_per_byte")[3] * np.log(2)
    assert nats_per_byte < records(str(tmp_path), "eval/loss")[3]  # a BPE token spans > 1 byte


def test_a_repeated_sigterm_keeps_saving_and_a_second_ctrl_c_aborts():
    with loop.Interrupt() as interrupt:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert interrupt.signal == "SIGTERM"
        with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)


def test_the_progress_bar_names_the_throughputs_unit():
    import types
    run = types.SimpleNamespace(task=types.SimpleNamespace(item_name="pairs"), throughput_key="train/pairs_per_s")
    last = {"train/loss": 0.6931, "train/pairs_per_s": 12.4, "train/mfu": 0.012}
    assert loop.Run.postfix(run, last) == {"loss": "0.693", "pairs_per_s": "12", "mfu": "1.2%"}
