"""The grpo task on a tiny chat run: rollouts, metrics and eval files, exact resume between rollouts, a bad
reward stopping the run in one line with its checkpoints kept."""

import json
import os
import sys
import types

import jax
import numpy as np
import pytest

from transformer import config as config_lib
from transformer import rundir
from transformer.training import loop, rewards, shapes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A tiny byte GPT pretrained 2 steps, then SFT'd 2 steps (its chat template: the built-in one)."""
    from conftest import SMALL_GPT
    base = tmp_path_factory.mktemp("grpo_runs")
    (base / "text.txt").write_text("1 + 2 = 3. 2 + 2 = 4. " * 200)
    pre, chat = base / "pre", base / "sft"
    common = ["train.steps=2", "train.sample_tokens=0", "train.eval_every=2", "train.checkpoint_every=2",
              "model.max_len=48", "data.batch_size=8"]
    loop.train(shapes.resolved(config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny"), [
        *SMALL_GPT, f"data.source={base / 'text.txt'}", "data.eval_fraction=0.3", *common])), str(pre))
    with open(base / "chat.jsonl", "w") as f:
        for a in range(8):
            f.write(json.dumps({"prompt": f"{a} + 1 =", "completion": str(a + 1)}) + "\n")
    loop.train(shapes.resolved(config_lib.load(os.path.join(REPO, f"configs/sft.py:init_from={pre}"), [
        f"data.train_path={base / 'chat.jsonl'}", f"data.eval_path={base / 'chat.jsonl'}", "data.seq_len=24",
        *common])), str(chat))
    prompts = base / "prompts.jsonl"
    with open(prompts, "w") as f:
        for a in range(12):
            f.write(json.dumps({"prompt": f"{a} + 1 =", "answer": str(a + 1)}) + "\n")
    return str(chat), str(prompts)


def grpo_config(chat_run, *overrides):
    chat, prompts = chat_run
    return shapes.resolved(config_lib.load(os.path.join(REPO, f"configs/grpo.py:init_from={chat}"), [
        f"data.train_path={prompts}", f"data.eval_path={prompts}", "data.batch_size=8", "data.eval_batches=1",
        "data.seq_len=16", "grpo.group_size=2", "grpo.max_new_tokens=4", "grpo.updates_per_rollout=2",
        "grpo.eval_prompts=3",
        "grpo.rewards=numeric,format=0.5", "grpo.kl_weight=0.1", "optim.lr=1e-2", "optim.warmup_steps=0",
        "train.steps=4", "train.log_every=1", "train.eval_every=4", "train.checkpoint_every=2", *overrides]))


@pytest.mark.slow
def test_a_stopped_grpo_run_resumes_exactly_between_rollouts(tmp_path, chat_run, capfd):
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    loop.train(grpo_config(chat_run), whole)
    said = capfd.readouterr().err
    assert "step 0: eval/answer_loss" in said and "eval/reward" in said and "eval/accuracy" in said
    loop.train(grpo_config(chat_run, "train.stop_at=3"), parts)  # stops after step 3 of 4: mid rollout batch
    held = np.load(os.path.join(parts, "rollouts", "train_batch.npz"))
    assert int(held["step"]) == 2 and held["seqs"].shape == (8, 16)
    loop.train(grpo_config(chat_run), parts)
    a, b = rundir.open(whole).restore_params(), rundir.open(parts).restore_params()
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    records = [json.loads(line) for line in open(os.path.join(whole, "metrics.jsonl"))]
    train = [r for r in records if "train/loss" in r]
    for key in ("reward", "reward_std", "accuracy", "completion_length", "clip_fraction", "kl", "entropy",
                "rollout_seconds", "rollout_share", "update_seconds"):
        assert all(np.isfinite(r[f"train/{key}"]) for r in train), key
    assert [r["train/rollout_seconds"] > 0 for r in train] == [True, False, True, False]
    assert train[0]["train/kl"] == pytest.approx(0.0, abs=1e-6)  # the first step's policy is the reference
    assert 0 < train[0]["train/rollout_share"] <= 1
    evals = [json.loads(line) for line in open(os.path.join(whole, "rollouts", "eval_000004.jsonl"))]
    assert len(evals) == 3 and {"prompt", "answer", "completion", "reward", "numeric", "format"} <= set(evals[0])
    assert "eval/answer_loss" in records[-1] or any("eval/answer_loss" in r for r in records)
    evaluated = [r for r in records if "eval/reward" in r]  # the held-out rollouts: at step 0 and each eval
    assert [r["step"] for r in evaluated] == [0, 4] and all(0 <= r["eval/accuracy"] <= 1 for r in evaluated)


@pytest.fixture
def flaky_reward(monkeypatch):
    """A reward that answers its first three calls (at launch, the step-0 eval, the first rollout) and raises
    on the fourth (the second rollout)."""
    calls = []

    def flaky(completions, examples):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("the grader is down")
        return [0.0] * len(completions)
    monkeypatch.setitem(sys.modules, "flaky_rewards", types.SimpleNamespace(flaky=flaky))


@pytest.mark.slow  # the chat_run fixture's two tiny runs (~40 s)
def test_a_failing_reward_stops_in_one_line_and_keeps_the_checkpoints(tmp_path, chat_run, flaky_reward):
    workdir = str(tmp_path / "run")
    with pytest.raises(rewards.RewardError) as error:
        loop.train(grpo_config(chat_run, "grpo.rewards=flaky_rewards:flaky", "grpo.kl_weight=0"), workdir)
    assert str(error.value) == "reward 'flaky_rewards:flaky' raised RuntimeError: the grader is down"
    assert rundir.open(workdir).checkpointer(3, 2).latest_step() == 2  # saved before the second rollout


def test_the_reference_under_lora_is_the_params_without_adapters():
    from transformer.layers import lora
    from transformer.training.tasks import grpo
    params = {"embed": np.ones(3), lora.ADAPTERS: {"a": np.zeros(2)}}
    reference = grpo.GRPOTask.reference_params(types.SimpleNamespace(), params)
    assert list(reference) == ["embed"] and reference["embed"] is params["embed"]  # no copy
