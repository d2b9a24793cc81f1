"""DPO: preference pairs read (a bad line fails naming it), the loss and rewards equal TRL's trainers' on the
same pairs and converted GPT-2s, and a tiny run from a tiny pretrained GPT that starts at zero reward, evals
and resumes exactly."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sft import WORDS, pretrained  # noqa: F401 (the fixture)

from transformer import config as config_lib
from transformer import models, rundir
from transformer.data.text import chat_templates as templates
from transformer.data.text import preferences, tokenizers
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
    bpe = tokenizers.train_bpe(["ab cd xyz"], 270)
    eos = bpe.special_id("[EOS]")
    path.write_text(json.dumps({"prompt": "ab", "chosen": " cd", "rejected": " xyz[EOS]"}) + "\n")
    pairs = preferences.read(str(path), 16, tokenizer=bpe)
    for side, text in ("chosen", " cd"), ("rejected", " xyz"):  # plain text ends in one [EOS], as in TRL
        ids = [*bpe.encode("ab"), *bpe.encode(text), eos, 0]
        assert getattr(pairs, side)[0, :len(ids)].tolist() == ids
    good = json.dumps({"prompt": "ab", "chosen": "c", "rejected": "d"})
    for bad, says in [({"prompt": "a", "chosen": "b"}, "missing rejected"),
                      ({"prompt": "a", "chosen": " ", "rejected": "b"}, "chosen is empty"),
                      ({"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": ""}]},
                       "rejected is empty"),
                      ({"prompt": "a" * 16, "chosen": "b", "rejected": "c"}, "the prompt is 16 tokens")]:
        path.write_text(f"{good}\n{json.dumps(bad)}\n")
        with pytest.raises(ValueError, match=f"p.jsonl:2: {says}"):
            preferences.read(str(path), 16, chat)


TEXT_PAIRS = [{"prompt": f"{w} is", "chosen": f" {w[::-1]} reversed.", "rejected": f"{f' {w}' * (i + 1)}."}
              for i, w in enumerate(WORDS[:3])]
CHAT_PAIRS = [{"prompt": [{"role": "user", "content": f"{w} is"}],
               "chosen": [{"role": "assistant", "content": f"{w[::-1]} reversed."}],
               "rejected": [{"role": "assistant", "content": f"{w * (i + 1)}."}]} for i, w in enumerate(WORDS[3:6])]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def hf_pair(tmp_path):
    """(policy run, reference run, the transformers tokenizer, policy, reference): two tiny random GPT-2s
    without dropout, sharing a byte-level BPE with an end of text and a ChatML template (whose completions end
    in a newline after the end of turn), saved and converted."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_hf import perturbed

    from transformer.interop import hf_import
    bpe = tokenizers.train_bpe([" ".join(f"{w} is {w[::-1]} reversed." for w in WORDS * 5)], 300).tokenizer
    eot = "<|endoftext|>"
    bpe.add_special_tokens([eot, "<|im_start|>", "<|im_end|>"])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eot, pad_token=eot,
                                               chat_template=CHATML)
    hf_config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=len(tok), n_positions=32,
                                        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    models_ = {}
    for seed, name in enumerate(("policy", "reference")):
        models_[name] = perturbed(transformers.GPT2LMHeadModel(hf_config), seed, scale=0.3)
        models_[name].save_pretrained(tmp_path / f"hf_{name}")
        tok.save_pretrained(tmp_path / f"hf_{name}")
        hf_import.convert(str(tmp_path / f"hf_{name}"), str(tmp_path / name))
    return str(tmp_path / "policy"), str(tmp_path / "reference"), tok, models_["policy"], models_["reference"]


def ours(tmp_path, pairs, policy, reference, loss, beta, gamma=0.0):
    """(the dpo task's train metrics, its eval metrics, its eval batch) for `pairs`, with the reference run as
    init_from and the policy run's weights as the trained model."""
    data = tmp_path / "parity.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    n = len(pairs)
    config = config_lib.load(os.path.join(REPO, f"configs/dpo.py:init_from={reference}"), [
        f"data.train_path={data}", f"data.eval_path={data}", "data.seq_len=30", f"data.batch_size={n}",
        "data.eval_batches=1", f"dpo.loss={loss}", f"dpo.beta={beta}", f"dpo.gamma={gamma}"])
    workdir = str(tmp_path / f"ours_{loss}")
    config = checks.checked(config, workdir=workdir).config
    task = dpo.build(config, workdir, np.arange(n), 0)
    model, params = models.build(config.model), rundir.open(policy).restore_params()
    _, train = task.loss(model, params, task.train_batch(0), jax.random.key(0))
    evaluated = task.eval_metrics([task.eval_outputs(model, params, b) for b in task.eval_batches()])
    return {k: float(v) for k, v in train.items()}, evaluated, task.eval_batches()[0]


def assert_same_rows(batch, input_ids, completion_mask):
    """Our chosen then rejected rows hold TRL's collated ids, and weigh exactly its completion tokens."""
    tokens = np.concatenate([batch["chosen"], batch["rejected"]])
    weights = np.concatenate([batch["chosen_weights"], batch["rejected_weights"]])
    for row, (ids, mask) in enumerate(zip(input_ids, completion_mask, strict=True)):
        end = np.flatnonzero(mask).max() + 1
        ids, mask = ids[:end], mask[:end]
        np.testing.assert_array_equal(tokens[row, :len(ids)], ids)
        np.testing.assert_array_equal(weights[row], np.pad(mask[1:], (0, weights.shape[1] - len(mask) + 1)))


def assert_same_numbers(train, evaluated, loss, logged):
    """Our train step's and eval's loss and rewards within 1e-5 of TRL's loss and logged metrics."""
    np.testing.assert_allclose(train["loss"], loss, atol=1e-5)
    np.testing.assert_allclose(evaluated["eval/loss"], loss, atol=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        np.testing.assert_allclose(train[key], logged[key], atol=1e-5, err_msg=key)
        np.testing.assert_allclose(evaluated[f"eval/{key}"], logged[key], atol=1e-5, err_msg=key)


@pytest.mark.torch
@pytest.mark.parametrize("loss,pairs", [("sigmoid", TEXT_PAIRS), ("ipo", TEXT_PAIRS), ("sigmoid", CHAT_PAIRS)],
                         ids=["sigmoid", "ipo", "sigmoid-chat"])
def test_loss_and_rewards_equal_trls_dpo_trainer(tmp_path, loss, pairs):
    """TRL's DPOTrainer (its tokenization, the end of text it adds to plain text, the chat template, collation,
    reference model and loss) on the same pairs, policy, reference and beta: our rows hold its ids and weigh
    its completion tokens, and our train and eval loss and rewards are within 1e-5."""
    torch = pytest.importorskip("torch")
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    policy_run, reference_run, tok, policy, reference = hf_pair(tmp_path)
    beta = 0.3  # bf16=False: TRL's default bf16 would run the reference model in bfloat16
    trainer = trl.DPOTrainer(model=policy, ref_model=reference, processing_class=tok,
                             train_dataset=datasets.Dataset.from_list(pairs),
                             args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, loss_type=[loss],
                                                report_to="none", use_cpu=True, bf16=False))
    batch = trainer.data_collator([{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
                                   for row in trainer.train_dataset])
    trainer.model.eval()
    with torch.no_grad():
        theirs = float(trainer.compute_loss(trainer.model, batch))
    logged = {k: v[-1] for k, v in trainer._metrics["eval"].items()}  # what TRL logs of this batch
    train, evaluated, eval_batch = ours(tmp_path, pairs, policy_run, reference_run, loss, beta)
    assert_same_rows(eval_batch, batch["input_ids"].numpy(), batch["completion_mask"].numpy())
    assert 0 < logged["rewards/accuracies"] < 1 and abs(logged["rewards/margins"]) > 0.05  # a batch that tells
    assert_same_numbers(train, evaluated, theirs, logged)


@pytest.mark.torch
def test_simpo_equals_trls_cpo_trainer(tmp_path):
    """SimPO as TRL 1.16 has it (its CPOTrainer with loss_type='simpo', cpo_alpha=0: DPOTrainer has no SimPO)
    on the same pairs and policy: our loss and rewards within 1e-5."""
    torch = pytest.importorskip("torch")
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    policy_run, reference_run, tok, policy, _ = hf_pair(tmp_path)
    beta, gamma = 2.0, 0.5
    trainer = CPOTrainer(model=policy, processing_class=tok, train_dataset=datasets.Dataset.from_list(TEXT_PAIRS),
                         args=CPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, loss_type="simpo", cpo_alpha=0.0,
                                        simpo_gamma=gamma, report_to="none", use_cpu=True, bf16=False))
    batch = trainer.data_collator(list(trainer.train_dataset))
    trainer.model.eval()
    with torch.no_grad():
        theirs, logged = trainer.get_batch_loss_metrics(trainer.model, batch, "train")
    train, evaluated, eval_batch = ours(tmp_path, TEXT_PAIRS, policy_run, reference_run, "simpo", beta, gamma)
    for side in ("chosen", "rejected"):
        np.testing.assert_array_equal(eval_batch[side][:, :batch[f"{side}_input_ids"].shape[1]],
                                      batch[f"{side}_input_ids"].numpy() * batch[f"{side}_attention_mask"].numpy())
    assert_same_numbers(train, evaluated, float(theirs), logged)


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
