"""DPO: preference pairs read (a bad line fails naming it), the losses and rewards equal TRL's formulas on a
converted GPT-2, and a tiny run from a tiny pretrained GPT that starts at zero reward, evals and resumes
exactly."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sft import WORDS, pretrained  # noqa: F401 (the fixture)

from transformer import config as config_lib
from transformer import rundir
from transformer.data.text import preferences, tokenizers
from transformer.inference import templates
from transformer.training import checks, loop, shapes
from transformer.training.tasks import dpo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_pairs(path, n, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            word = str(rng.choice(WORDS))
            f.write(json.dumps({"prompt": f"{word} is", "chosen": f" {word[::-1]} reversed.",
                                "rejected": f" {word} reversed."}) + "\n")


def test_read_pairs_and_bad_lines(tmp_path):
    chat = templates.built_in(tokenizers.ByteTokenizer())
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ab", "chosen": "cd", "rejected": "xyz"}) + "\n\n" + json.dumps(
        {"prompt": [{"role": "user", "content": "hi"}], "chosen": "yes", "rejected": [
            {"role": "assistant", "content": "no"}]}) + "\n")
    pairs = preferences.read(str(path), 16, chat)
    assert len(pairs) == 2 and pairs.where == [f"{path}:1", f"{path}:3"]
    assert pairs.chosen[0, :4].tolist() == list(b"abcd") and pairs.chosen_mask[0].sum() == 2
    assert pairs.rejected_mask[0].sum() == 3 and not pairs.rejected_mask[0, :2].any()
    ids, mask = chat.encode([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}])
    np.testing.assert_array_equal(pairs.chosen[1, :len(ids)], ids)
    np.testing.assert_array_equal(pairs.chosen_mask[1, :len(ids)], mask)
    good = json.dumps({"prompt": "ab", "chosen": "c", "rejected": "d"})
    for bad, says in [({"prompt": "a", "chosen": "b"}, "missing rejected"),
                      ({"prompt": "a", "chosen": " ", "rejected": "b"}, "chosen is empty"),
                      ({"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": ""}]},
                       "rejected is empty"),
                      ({"prompt": "a" * 16, "chosen": "b", "rejected": "c"}, "the prompt is 16 tokens")]:
        path.write_text(f"{good}\n{json.dumps(bad)}\n")
        with pytest.raises(ValueError, match=f"p.jsonl:2: {says}"):
            preferences.read(str(path), 16, chat)


@pytest.mark.torch
def test_losses_and_rewards_equal_trls_formulas(tmp_path):
    """TRL 1.16's DPOTrainer._compute_loss, its sigmoid and ipo lines, on a converted GPT-2's log-probs."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformer.interop import hf_import
    F = torch.nn.functional
    torch.manual_seed(0)
    theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=101, n_positions=32, bos_token_id=0, eos_token_id=0)).eval()
    theirs.save_pretrained(tmp_path / "hf")
    hf_import.convert(str(tmp_path / "hf"), str(tmp_path / "run"))
    run = rundir.open(str(tmp_path / "run"))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 101, (8, 12)).astype(np.int32)  # [2B, W]: chosen rows then rejected rows
    at = np.arange(12)[None]
    completion = (at >= rng.integers(3, 6, (8, 1))) & (at < rng.integers(8, 13, (8, 1)))  # [2B, W]
    with torch.no_grad():
        logits = theirs(input_ids=torch.tensor(tokens, dtype=torch.long)).logits[:, :-1]
        per_token = torch.gather(logits.log_softmax(-1), 2, torch.tensor(tokens[:, 1:], dtype=torch.long)[..., None])
    mask = torch.tensor(completion)
    logps = (per_token[..., 0] * mask[:, 1:]).sum(1)
    ours, counts = dpo.sequence_logps(run.model(), run.restore_params(), jnp.asarray(tokens),
                                      jnp.asarray(completion[:, 1:]))
    np.testing.assert_allclose(np.asarray(ours), logps.numpy(), rtol=1e-5, atol=1e-5)
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = chosen + torch.tensor([0.3, -0.2, 0.1, 0.5]), rejected + torch.tensor([-0.4, 0.2, 0, 1])
    beta = 0.3
    delta = (chosen - ref_chosen) - (rejected - ref_rejected)
    chosen_mask, rejected_mask = mask.chunk(2)
    ipo_delta = (chosen - ref_chosen) / chosen_mask.sum(1) - (rejected - ref_rejected) / rejected_mask.sum(1)
    expected = {"sigmoid": -F.logsigmoid(beta * delta), "ipo": (ipo_delta - 1 / (2 * beta)) ** 2}
    oc, orr = jnp.split(ours, 2)
    nc, nr = jnp.split(counts, 2)
    for kind, loss in expected.items():
        got, rc, rr = dpo.preference_loss(oc, orr, jnp.asarray(ref_chosen.numpy()), jnp.asarray(ref_rejected.numpy()),
                                          nc, nr, beta, kind)
        np.testing.assert_allclose(float(got.mean()), float(loss.mean()), atol=1e-5)
        np.testing.assert_allclose(np.asarray(rc), (beta * (chosen - ref_chosen)).numpy(), atol=1e-5)
        np.testing.assert_allclose(np.asarray(rr), (beta * (rejected - ref_rejected)).numpy(), atol=1e-5)
    simpo, _, _ = dpo.preference_loss(oc, orr, 0.0, 0.0, nc, nr, 2.0, "simpo", 0.5)
    avg = chosen / chosen_mask[:, 1:].sum(1) - rejected / rejected_mask[:, 1:].sum(1)
    np.testing.assert_allclose(np.asarray(simpo), (-F.logsigmoid(2.0 * avg - 0.5)).numpy(), atol=1e-5)


def dpo_config(start, data, *overrides):
    return config_lib.load(os.path.join(REPO, f"configs/dpo.py:init_from={start}"), [
        f"data.train_path={data}", "data.seq_len=24", "data.batch_size=8", "data.eval_batches=2",
        "data.eval_fraction=0.3", "dpo.beta=0.5", "optim.lr=3e-3", "optim.warmup_steps=1", "train.steps=4",
        "train.log_every=1", "train.eval_every=2", "train.checkpoint_every=2", "train.sample_tokens=0", *overrides])


def records(workdir, key):
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return {r["step"]: r[key] for r in rows if key in r}


@pytest.mark.slow
def test_a_dpo_run_starts_at_zero_reward_evals_and_resumes_exactly(tmp_path, pretrained):  # noqa: F811
    data = tmp_path / "prefs.jsonl"
    write_pairs(data, 40)
    loop.train(shapes.resolved(dpo_config(pretrained, data)), str(tmp_path / "whole"))
    loop.train(shapes.resolved(dpo_config(pretrained, data, "train.stop_at=2")), str(tmp_path / "paused"))
    assert os.path.isfile(tmp_path / "paused" / dpo.REFERENCE)
    loop.train(shapes.resolved(dpo_config(pretrained, data)), str(tmp_path / "paused"))
    whole, paused = (records(str(tmp_path / w), "train/loss") for w in ("whole", "paused"))
    assert sorted(whole) == sorted(paused) == [1, 2, 3, 4]
    np.testing.assert_allclose([paused[s] for s in whole], list(whole.values()), rtol=1e-6)
    first = min(records(str(tmp_path / "whole"), "train/rewards/chosen").items())
    assert first[0] == 1 and abs(first[1]) < 1e-4  # the policy starts as the reference
    accuracy = records(str(tmp_path / "whole"), "eval/rewards/accuracies")
    margins = records(str(tmp_path / "whole"), "eval/rewards/margins")
    assert sorted(accuracy) == [2, 4] and 0 <= accuracy[4] <= 1 and margins[4] > margins[2]
    with pytest.raises(ValueError, match="config.dpo.loss='kl'"):
        loop.train(shapes.resolved(dpo_config(pretrained, data, "dpo.loss=kl")), str(tmp_path / "bad"))


@pytest.mark.slow
def test_under_lora_the_reference_is_the_base_with_the_adapters_off(tmp_path, pretrained):  # noqa: F811
    data = tmp_path / "prefs.jsonl"
    write_pairs(data, 40)
    run = loop.setup(checks.checked(dpo_config(pretrained, data, "lora.rank=4")), str(tmp_path / "lora"))
    assert "lora" in run.state.params
    batch = run.task.train_batch(0)
    base = rundir.open(pretrained)
    ref, _ = dpo.sequence_logps(base.model(), base.restore_params(), jnp.asarray(batch["chosen"]),
                                jnp.asarray(batch["chosen_weights"]))
    np.testing.assert_allclose(batch["ref_chosen"], np.asarray(ref), rtol=1e-5)
    loss, metrics = run.task.loss(run.model, run.state.params, batch, jax.random.key(0))
    np.testing.assert_allclose(float(loss), np.log(2), rtol=1e-5)  # -log sigmoid(0): the policy is the reference
    assert abs(float(metrics["rewards/margins"])) < 1e-5
