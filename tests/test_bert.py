"""The BERT family: pinned sizes, padding invariance, MLM masking, loaders, label alignment, runs."""

import filecmp
import json
import os
import shutil
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO

from transformer import config as config_lib
from transformer import models, rundir
from transformer.data.text import labelled
from transformer.models import bert, summary
from transformer.training import checks, loop, shapes
from transformer.training import metrics as metrics_lib
from transformer.training.tasks import mlm

# Parameter counts per preset with head="none" and the pooler (Hugging Face's BertModel).
PINNED = {
    "tiny": 1_350_784,
    "longformer-tiny": 1_858_688,  # tiny with 4,096 learned positions
    "bert-base": 109_482_240,
    "bert-large": 335_141_888,
}


@pytest.mark.parametrize("preset", sorted(bert.PRESETS))
def test_pinned_parameter_counts(preset):
    assert preset in PINNED, f"preset {preset!r} has no pinned parameter count"
    cfg = bert.default_model_config(preset)
    cfg.update(head="none", pooler=True)
    assert models.count_params(cfg) == PINNED[preset]


def test_inspect_prints_bert_base_with_the_mlm_head_of_hugging_face_bert_for_masked_lm():
    config = config_lib.load(os.path.join(REPO, "configs/bert.py:bert-base"))
    table = summary.summarize(shapes.resolved(config))  # a WordPiece of 30,522 ids trained on the stdlib
    assert table["total"] == 109_514_298
    assert "type_embed" in summary.format_summary(table)


def small_model(**overrides):
    cfg = bert.default_model_config("tiny")
    cfg.update(num_layers=2, d_model=32, num_heads=4, mlp_dim=64, max_len=24, vocab_size=50, num_labels=3)
    cfg.update(overrides)
    return bert.build(cfg)


@pytest.mark.parametrize("head", ["pretrain", "sequence", "token", "none"])
def test_padding_does_not_change_the_outputs_at_real_positions(head):
    model = small_model(head=head, nsp=True)
    tokens = jax.random.randint(jax.random.key(1), (2, 7), 1, 50)
    type_ids = jnp.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1]])
    params = model.init(jax.random.key(0), tokens, type_ids)["params"]
    plain = model.apply({"params": params}, tokens, type_ids)
    pad = lambda x, v: jnp.concatenate([x, jnp.full((2, 4), v, x.dtype)], axis=1)
    valid = pad(jnp.ones((2, 7), bool), False)
    padded = model.apply({"params": params}, pad(tokens, 0), pad(type_ids, 0), valid)
    assert plain.keys() == padded.keys() and plain
    for key, value in plain.items():
        cut = padded[key][:, :7] if value.ndim == 3 else padded[key]
        np.testing.assert_allclose(cut, value, atol=1e-5, err_msg=key)


def test_heads_share_the_encoder_paths():
    tokens = jnp.ones((1, 5), jnp.int32)
    paths = {head: set(small_model(head=head).init(jax.random.key(0), tokens)["params"])
             for head in ("pretrain", "sequence", "token", "none")}
    body = {"embed", "pos_embed", "type_embed", "embed_norm", "block_0", "block_1"}
    assert all(body <= p for p in paths.values())
    assert paths["sequence"] - body == {"pooler", "classifier"} and paths["token"] - body == {"classifier"}


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="config.model.head='nope'"):
        small_model(head="nope")
    with pytest.raises(ValueError, match="unknown bert task 'nope'"):
        config_lib.load(os.path.join(REPO, "configs/bert.py:tiny,task=nope"))
    config = config_lib.load(os.path.join(REPO, "configs/bert.py:tiny,task=token_classification"))
    assert config.model.head == "token" and models.task_of(config.model) == "token_classification"


def test_mlm_masking_statistics_and_no_special_token_is_masked():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, (256, 128))
    ids[:, 0], ids[:, -1] = 2, 3
    specials, random_ids = np.arange(7), np.arange(7, 100)
    masked, selected = mlm.mask_tokens(ids, mlm.mask_draws(rng, ids.shape, random_ids), specials, 4)
    special = np.isin(ids, specials)
    assert not selected[special].any() and (masked[special] == ids[special]).all()
    assert abs(selected[~special].mean() - 0.15) < 0.005
    to_mask = masked[selected] == 4
    kept = masked[selected] == ids[selected]
    replaced = ~to_mask & ~kept
    assert abs(to_mask.mean() - 0.8) < 0.01 and abs(kept.mean() - 0.1) < 0.01
    assert abs(replaced.mean() - 0.1) < 0.01 and not np.isin(masked[selected][replaced], specials).any()
    assert (masked[~selected] == ids[~selected]).all()


def test_loaders_read_the_formats_and_name_file_and_line_of_a_bad_one(tmp_path):
    good = tmp_path / "a.tsv"
    good.write_text("pos\tgreat film\n\nneg\tdull, long\n")
    assert labelled.read_labelled(str(good)) == [("pos", "great film"), ("neg", "dull, long")]
    bad = tmp_path / "b.tsv"
    bad.write_text("pos\tgreat\nno tab here\n")
    with pytest.raises(ValueError, match=f"^{bad}:2: expected label<TAB>text"):
        labelled.read_labelled(str(bad))
    conll = tmp_path / "a.conll"
    conll.write_text("x\tNAME\n=\tOP\n\n\n1\tNUMBER\n")
    assert labelled.read_conll(str(conll)) == [(["x", "="], ["NAME", "OP"]), (["1"], ["NUMBER"])]
    conll.write_text("x\tNAME\n\ny\tNAME\textra\n")
    with pytest.raises(ValueError, match=f"^{conll}:3: expected token<TAB>tag"):
        labelled.read_conll(str(conll))


def test_a_word_label_sits_on_its_first_sub_token_only():
    ids, labels = labelled.align([[5, 6], [7], [], [8, 9, 10]], [1, 2, 3, 4], seq_len=8, unk=1)
    ignore = labelled.IGNORE
    assert ids == [5, 6, 7, 1, 8, 9]
    assert labels == [1, ignore, 2, 3, 4, ignore]


SMALL_BERT = [
    "model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.mlp_dim=64", "model.max_len=32",
    "model.vocab_size=400", "data.vocab_size=400", "data.seq_len=24", "data.batch_size=8", "data.eval_batches=2",
    "optim.lr=3e-3", "optim.warmup_steps=1", "train.steps=4", "train.log_every=1", "train.eval_every=2",
    "train.checkpoint_every=2",
]
STDLIB_FILES = ["json/decoder.py", "json/encoder.py", "textwrap.py", "fnmatch.py", "bisect.py", "glob.py"]


def bert_config(arg, *overrides):
    return shapes.resolved(config_lib.load(os.path.join(REPO, f"configs/bert.py:{arg}"), [*SMALL_BERT, *overrides]))


def eval_records(workdir):
    return [r for r in metrics_lib.read(os.path.join(workdir, "metrics.jsonl")) if "eval/loss" in r]


@pytest.mark.parametrize("nsp", [False, True])
def test_a_process_builds_only_its_rows_and_they_are_those_of_the_global_batch(tmp_path, nsp):
    source = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
    config = bert_config("tiny", f"data.source={source}", "data.eval_fraction=0.3", f"model.nsp={nsp}",
                         "data.batch_size=8")
    whole = mlm.build(config, str(tmp_path), np.arange(8), 0)
    quarters = [mlm.build(config, str(tmp_path), np.array([i, i + 4]), 0) for i in range(4)]  # interleaved rows
    batch, parts = whole.train_batch(5), [q.train_batch(5) for q in quarters]
    assert batch["selected"].any() and all(len(p["tokens"]) == 2 for p in parts)
    for key in batch:
        rebuilt = np.empty_like(batch[key])
        for i, part in enumerate(parts):
            rebuilt[[i, i + 4]] = part[key]
        np.testing.assert_array_equal(rebuilt, batch[key], err_msg=key)
    for key in whole.eval_batches()[0]:
        np.testing.assert_array_equal(quarters[1].eval_batches()[0][key], whole.eval_batches()[0][key][[1, 5]])


@pytest.mark.parametrize("nsp", [False, True])
def test_the_logged_train_loss_weighs_each_step_by_its_masked_tokens(tmp_path, nsp):
    """Two steps of different masked-token counts: train/loss is their summed token losses over their
    tokens (plus, with next-sentence prediction, its mean over the rows), not the mean of the two means."""
    source = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
    run = loop.setup(checks.checked(bert_config("tiny", f"data.source={source}", "data.eval_fraction=0.3",
                                                 f"model.nsp={nsp}")),
                     str(tmp_path / "run"))
    try:
        state, fetched, tokens = run.state, [], []
        for step in range(2):
            batch = run.task.train_batch(step)
            tokens.append(int(batch["selected"].sum()))
            state, metrics = run.compiled_step(state, run.place(batch), run.step_rng)
            fetched.append(jax.device_get(metrics))
    finally:
        run.ckpt.close()
        run.writer.close()
    logged, _ = metrics_lib.over_steps(fetched)
    per_step = np.array([m["mlm_loss" if nsp else "loss"] for m in fetched], np.float64)
    weighted = float(per_step @ tokens / sum(tokens))
    nsp_mean = float(np.mean([m["nsp_loss"] for m in fetched])) if nsp else 0.0
    assert tokens[0] != tokens[1] and abs(weighted - per_step.mean()) > 1e-5 * weighted
    np.testing.assert_allclose(logged["train/loss"], weighted + nsp_mean, rtol=1e-6)
    assert not nsp or np.isclose(logged["train/mlm_loss"], weighted, rtol=1e-6)
    assert not any(k.startswith("train/" + metrics_lib.ITEMS) for k in logged)


@pytest.mark.slow
def test_pretrain_then_fine_tune_from_it_and_restore_to_the_same_eval(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    root = sysconfig.get_paths()["stdlib"]
    for name in STDLIB_FILES:
        shutil.copy(os.path.join(root, name), corpus / name.replace("/", "_"))
    pre = str(tmp_path / "pre")
    last = loop.train(bert_config("tiny", f"data.source={corpus}/*.py", "data.eval_fraction=0.3"), pre)
    assert {"eval/loss", "eval/mlm_accuracy", "eval/unigram_loss"} <= set(last)
    assert np.isfinite(last["eval/loss"])
    config = bert_config("tiny", f"data.source={corpus}/*.py", "data.eval_fraction=0.3")
    task = mlm.build(config, pre, np.arange(config.data.batch_size), 0)
    first, again, other = task.train_batch(3), task.train_batch(3), task.train_batch(4)
    assert all(np.array_equal(first[k], again[k]) for k in first)
    assert not np.array_equal(first["tokens"], other["tokens"])
    assert not first["selected"][np.isin(first["targets"], task.special_ids)].any()

    lines = labelled._logical_lines(open(os.path.join(root, "textwrap.py")).read())
    for split, part in (("train", lines[:60]), ("eval", lines[60:90])):
        (tmp_path / f"{split}.conll").write_text("".join(
            "".join(f"{t}\t{tag}\n" for t, tag in sentence) + "\n" for sentence in part))
    ft = str(tmp_path / "ft")
    config = bert_config("tiny,task=token_classification", f"init_from={pre}",
                         f"data.train_path={tmp_path / 'train.conll'}", f"data.eval_path={tmp_path / 'eval.conll'}")
    last = loop.train(config, ft)
    assert filecmp.cmp(os.path.join(pre, "tokenizer.json"), os.path.join(ft, "tokenizer.json"), shallow=False)
    assert os.path.isfile(os.path.join(ft, rundir.LABELS))
    assert {"eval/accuracy", "eval/macro_f1", "eval/majority_accuracy"} <= set(last)

    run = loop.setup(checks.checked(config), ft)
    try:
        restored = loop.evaluate(run, run.state.params)
    finally:
        run.ckpt.close()
        run.writer.close()
    recorded = eval_records(ft)[-1]
    assert recorded["step"] == 4
    for key, value in restored.items():
        np.testing.assert_allclose(value, recorded[key], rtol=1e-5, err_msg=key)


def write_moods(path, rows: int, seed: int):
    rng = np.random.default_rng(seed)
    moods = {"neg": "dull awful", "neu": "fine plain", "pos": "great lovely"}
    path.write_text("".join(f"{label}\t{rng.choice(moods[label].split())} film\n"
                            for label in rng.permutation(list(moods) * (rows // 3))))


def test_a_classifier_takes_its_number_of_labels_from_its_train_data(tmp_path):
    train, conll = tmp_path / "train.tsv", tmp_path / "train.conll"
    write_moods(train, 12, 0)
    conll.write_text("x\tNAME\n=\tOP\n\n1\tNUMBER\n")
    spec = os.path.join(REPO, "configs/bert.py:tiny,task=sequence_classification")
    def resolve(*overrides, spec=spec, path=train):
        config = config_lib.load(spec, [*SMALL_BERT, f"data.train_path={path}", f"data.eval_path={path}", *overrides])
        return config, shapes.resolve(config)
    config, says = resolve()
    assert config.model.num_labels == 3 and says == [
        f"data: {train}: 12 labelled texts, 3 labels (neg, neu, pos), tokenized by wordpiece (400 ids, trained on it)",
        "from the data: data.tokenizer='wordpiece', model.num_labels=3"]
    config, says = resolve("model.num_labels=5")
    assert config.model.num_labels == 5 and says[1:] == [
        f"config.model.num_labels=5: {train} holds 3 labels; the head's other 2 outputs are never a target",
        "from the data: data.tokenizer='wordpiece'"]
    with pytest.raises(ValueError, match=r"^config.model.num_labels=2 but .*train.tsv holds 3 labels: raise it"):
        resolve("model.num_labels=2")
    _, says = resolve(spec=spec.replace("sequence", "token"), path=conll)
    assert says[0].startswith(f"data: {conll}: 2 tagged sentences (3 words), 3 labels (NAME, NUMBER, OP), tokenized")
    _, says = resolve(path="")
    assert says[0].startswith(f"data: the embedded package task: {labelled.NUM_PACKAGES} labels (stdlib packages)")


def test_a_classifier_trains_on_labels_it_was_not_told_and_its_run_keeps_them(tmp_path):
    for split, seed in (("train", 0), ("eval", 1)):
        write_moods(tmp_path / f"{split}.tsv", 24, seed)
    config = config_lib.load(os.path.join(REPO, "configs/bert.py:tiny,task=sequence_classification"), [
        *SMALL_BERT, f"data.train_path={tmp_path / 'train.tsv'}", f"data.eval_path={tmp_path / 'eval.tsv'}"])
    assert config.model.num_labels == 0
    last = loop.train(config, str(tmp_path / "run"))
    assert np.isfinite(last["eval/loss"])
    run = rundir.open(str(tmp_path / "run"))
    assert run.config.model.num_labels == 3 and run.labels == ["neg", "neu", "pos"]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["sequence_classification", "token_classification"])
def test_fine_tuning_a_classifier_keeps_the_label_order_of_the_head_it_loads(tmp_path, task):
    """A classifier whose labels.json is not in sorted order (a converted one's id2label): a run fine-tuned from
    it loads its head, so it gives each label the head's id; data of a label the head does not have starts a new
    head."""
    def write(name, labels):
        rows = [(label, {"neg": "dull", "neu": "fine", "pos": "great"}[label]) for label in labels * 4]
        lines = ([f"{label}\t{word} film\n" for label, word in rows] if task == "sequence_classification" else
                 [f"{word}\t{label}\nfilm\tneg\n\n" for label, word in rows])
        (tmp_path / name).write_text("".join(lines))
        return [f"data.train_path={tmp_path / name}", f"data.eval_path={tmp_path / name}"]
    pre, ft = str(tmp_path / "pre"), str(tmp_path / "ft")
    data = write("data", ["pos", "neg"])
    loop.train(bert_config(f"tiny,task={task}", *data, "train.steps=1"), pre)
    with open(os.path.join(pre, rundir.LABELS), "w") as f:
        json.dump(["pos", "neg"], f)
    run = loop.setup(checks.checked(bert_config(f"tiny,task={task}", *data, f"init_from={pre}")), ft)
    try:
        head = rundir.open(pre).restore_params()["classifier"]
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(run.state.params["classifier"]), head)
        assert run.task.names == rundir.open(ft).labels == ["pos", "neg"]
        labels = run.task.data.train["labels"]
        assert set(labels[::2] if labels.ndim == 1 else labels[::2, 1]) == {0}  # the texts (words) labelled pos
    finally:
        run.ckpt.close()
        run.writer.close()
    run = loop.setup(checks.checked(bert_config(f"tiny,task={task}", *write("more", ["neu", "pos", "neg"]),
                                                 f"init_from={pre}")),
                     str(tmp_path / "more_run"))
    try:
        assert run.task.names == ["neg", "neu", "pos"] and run.state.params["classifier"]["bias"].shape == (3,)
        assert run.task.new_head == "its labels are pos, neg, this run's neg, neu, pos"
    finally:
        run.ckpt.close()
        run.writer.close()
