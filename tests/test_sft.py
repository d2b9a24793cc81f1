"""Supervised fine-tuning: conversations read and packed, the loss only on assistant tokens, a tiny run from
a tiny pretrained GPT that grows the vocabulary by the chat markers and learns to answer."""

import json
import os

import jax
import numpy as np
import pytest

from transformer import config as config_lib
from transformer import rundir
from transformer.data.text import chat_templates as templates
from transformer.data.text import conversations, tokenizers
from transformer.layers import cross_entropy
from transformer.training import checks, loop, shapes
from transformer.training.tasks import sft

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ["cat", "dog", "sun", "red", "sky", "box"]


def write_conversations(path, n, seed=0):
    """n conversations 'reverse: WORD' -> the word reversed; every third a prompt/completion pair."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            word = str(rng.choice(WORDS))
            if i % 3:
                row = {"messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": f"reverse {word}"},
                                    {"role": "assistant", "content": word[::-1]}]}
            else:
                row = {"prompt": f"reverse {word}", "completion": word[::-1]}
            f.write(json.dumps(row) + "\n")


def test_read_and_pack(tmp_path):
    path = tmp_path / "chat.jsonl"
    write_conversations(path, 6)
    read = conversations.read(str(path))
    word = read[0][0]["content"].split()[1]
    assert read[0] == [{"role": "user", "content": f"reverse {word}"}, {"role": "assistant", "content": word[::-1]}]
    assert [m["role"] for m in read[1]] == ["system", "user", "assistant"]
    chat = templates.built_in(tokenizers.ByteTokenizer())
    encoded = conversations.encode(chat, read, 40, "x")
    packed = conversations.pack(encoded.examples, 40)
    assert sum(len(ids) for ids, _ in encoded.examples) == (packed.segments > 0).sum()
    assert len(packed) < len(read)  # several to a row
    batch = packed.batch(np.arange(len(packed)))
    assert batch["weights"].sum() == sum(m[1:].sum() for _, m in encoded.examples)
    assert (batch["positions"][batch["segments"] > 0] < 40).all()
    cut = conversations.encode(chat, read, 24, "x")
    assert (cut.cut, cut.dropped) == (4, 4)  # the system turn's conversations lose their answer
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\n{"text": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        conversations.read(str(tmp_path / "bad.jsonl"))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from conftest import SMALL_GPT
    workdir = tmp_path_factory.mktemp("pre")
    for i in range(8):
        (workdir / f"text{i}.txt").write_text(" ".join(f"{w} is {w[::-1]} reversed." for w in WORDS * 10))
    text = workdir / "*.txt"
    config = config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny"),
                             [*SMALL_GPT, f"data.source={text}", "data.eval_fraction=0.3", "model.max_len=64",
                              "data.seq_len=32", "train.steps=4", "train.sample_tokens=0"])
    loop.train(shapes.resolved(config), str(workdir))
    return str(workdir)


def sft_config(pretrained, data, *overrides):
    return config_lib.load(os.path.join(REPO, f"configs/sft.py:init_from={pretrained}"), [
        f"data.train_path={data}", "data.seq_len=48", "data.batch_size=8", "data.eval_batches=1",
        "optim.lr=1e-2", "optim.warmup_steps=5", "train.log_every=10", "train.eval_every=60",
        "train.checkpoint_every=60", "train.sample_tokens=0", *overrides])


@pytest.mark.slow
def test_sft_grows_the_vocabulary_and_learns_the_answers(tmp_path, pretrained):
    data = tmp_path / "chat.jsonl"
    write_conversations(data, 200)
    write_conversations(tmp_path / "held.jsonl", 10, seed=1)
    config = sft_config(pretrained, data, "train.steps=150", f"data.eval_path={tmp_path / 'held.jsonl'}")
    loop.train(shapes.resolved(config), str(tmp_path / "sft"))
    run = rundir.open(str(tmp_path / "sft"))
    assert run.config.task == "sft" and run.config.model.vocab_size == 256 + 4
    params = run.restore_params()
    before = rundir.open(pretrained).restore_params()
    np.testing.assert_array_equal(params["embed"]["embedding"][:256].shape, before["embed"]["embedding"].shape)
    chat = templates.for_run(str(tmp_path / "sft"))
    right = sum(sft.reply(run.model(), params, chat, [{"role": "user", "content": f"reverse {w}"}], 6) == w[::-1]
                for w in WORDS)
    assert right >= 4
    records = [json.loads(line) for line in open(tmp_path / "sft" / "metrics.jsonl")]
    assert records[-1]["eval/loss"] < 0.5


def test_the_loss_counts_only_assistant_tokens(tmp_path, pretrained):
    data = tmp_path / "chat.jsonl"
    write_conversations(data, 40)
    run = loop.setup(checks.checked(sft_config(pretrained, data, "train.steps=1", "data.eval_fraction=0.3")),
                     str(tmp_path / "sft"))
    batch = run.task.train_batch(0)
    loss, _ = run.task.loss(run.model, run.state.params, batch, jax.random.key(0))
    logits = run.model.apply({"params": run.state.params}, batch["tokens"][:, :-1], segments=batch["segments"],
                             positions=batch["positions"])
    token_losses = np.asarray(cross_entropy.token_losses(logits, batch["tokens"][:, 1:]))
    weights = batch["weights"]
    assert 0 < weights.sum() < weights.size / 2
    np.testing.assert_allclose(float(loss), (token_losses * weights).sum() / weights.sum(), rtol=1e-5)
    assert run.task.loss_weights(batch)["loss"] == weights.sum()
