"""A run directory answers questions after training: evaluate (every family, any step, another eval set, a
converted run) and predict (BERT sequence and token classification, ViT on a folder), as commands and
through `classifier.Classifier(rundir.open(DIR))`."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import FAST_COMPILES, REPO, write_pairs
from PIL import Image
from test_bert import SMALL_BERT
from test_encdec import SMALL as SMALL_ENCDEC
from test_vit import SMALL_VIT

from transformer import config as config_lib
from transformer import models, rundir
from transformer.data.images import folders
from transformer.inference import classifier
from transformer.training import evaluation, loop
from transformer.training import metrics as metrics_lib

ONE = jax.devices()[:1]
WORDS = {"pos": ["great", "superb", "lovely"], "neg": ["dull", "awful", "tedious"]}


def eval_records(workdir) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")}
            for r in metrics_lib.read(os.path.join(workdir, "metrics.jsonl")) if "eval/loss" in r}


def assert_evaluates_as_training_did(workdir, step=None, **kwargs):
    done, metrics = evaluation.evaluate_run(str(workdir), step, devices=ONE, **kwargs)
    assert metrics == pytest.approx(eval_records(workdir)[done], rel=1e-5)
    return done, metrics


def cli(module, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILES}
    return subprocess.run([sys.executable, "-m", f"transformer.{module}", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def write_reviews(path, n, seed):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            label = rng.choice(list(WORDS))
            f.write(f"{label}\t{' '.join(rng.choice(WORDS[label], 3))} film\n")


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bert-seq")
    write_reviews(tmp / "train.tsv", 48, 0)
    write_reviews(tmp / "eval.tsv", 16, 1)
    config = config_lib.load(os.path.join(REPO, "configs/bert.py:tiny,task=sequence_classification"), [
        *SMALL_BERT, f"data.train_path={tmp / 'train.tsv'}",
        f"data.eval_path={tmp / 'eval.tsv'}"])
    loop.train(config, str(tmp / "run"), devices=ONE)
    return tmp


@pytest.mark.slow
def test_bert_classifier_evaluates_at_any_step_and_on_another_eval_set(bert_run):
    run = bert_run / "run"
    assert_evaluates_as_training_did(run)
    assert_evaluates_as_training_did(run, step=2)
    _, other = evaluation.evaluate_run(str(run), overrides={"data.eval_path": str(bert_run / "train.tsv")},
                                       devices=ONE)
    assert other["eval/majority_accuracy"] != eval_records(run)[4]["eval/majority_accuracy"]
    records = metrics_lib.read(str(run / rundir.EVALS))
    assert [(r["step"], r["overrides"]) for r in records] == [
        (4, {}), (2, {}), (4, {"data.eval_path": str(bert_run / "train.tsv")})]
    assert not os.path.exists(run / "data.json")  # the run's own files are untouched
    with pytest.raises(ValueError, match="--step=3: .* steps 2, 4"):
        evaluation.evaluate_run(str(run), 3, devices=ONE)
    with pytest.raises(ValueError, match="config.model.d_model"):
        rundir.open(str(run)).with_overrides({"model.d_model": "8"})
    for family in ("bert", "vit"):  # what generate says to a classifier names the commands that serve it
        assert "python -m transformer.evaluate" in models.family(family).no_generation
        assert "python -m transformer.predict" in models.family(family).no_generation


def test_the_python_api_classifies_a_new_sentence_as_its_eval_does(bert_run):
    run = rundir.open(str(bert_run / "run"))
    assert run.labels == ["neg", "pos"]
    classify = classifier.Classifier(run)
    (one,) = classify(["a lovely superb film"])
    assert one["label"] in ("neg", "pos") and sum(one["probabilities"].values()) == pytest.approx(1, abs=1e-5)
    texts, targets = classifier.read_inputs(classify.task, str(bert_run / "eval.tsv"))
    predicted = [p["label"] for p in classify(texts)]
    accuracy = np.mean([p == t for p, t in zip(predicted, targets)])
    assert accuracy == pytest.approx(eval_records(run.path)[4]["eval/accuracy"])
    assert len(classifier.Classifier(run, step=2, top_k=1)(texts[:1])[0]["probabilities"]) == 1


@pytest.mark.slow
def test_a_classifier_fine_tunes_onto_other_labels_with_a_new_head_and_keeps_its_head_for_its_own(
        bert_run, tmp_path, capsys):
    def finetune(name, words):
        with open(tmp_path / f"{name}.tsv", "w") as f:
            f.writelines(f"{label}\t{word} film\n" for label, word in words * 4)
        config = config_lib.load(os.path.join(REPO, "configs/bert.py:tiny,task=sequence_classification"), [
            *SMALL_BERT, "train.steps=1", f"data.train_path={tmp_path / name}.tsv",
            f"data.eval_path={tmp_path / name}.tsv", f"init_from={bert_run / 'run'}"])
        loop.train(config, str(tmp_path / name), devices=ONE)
        return rundir.open(str(tmp_path / name)).labels, capsys.readouterr().err

    labels, said = finetune("three", [("good", "great"), ("bad", "awful"), ("meh", "fine")])
    assert labels == ["bad", "good", "meh"]
    assert ("a new head (classifier/bias, classifier/kernel start fresh): its labels are neg, pos, this run's "
            "bad, good, meh") in said
    labels, said = finetune("same", [("pos", "great"), ("neg", "awful")])
    assert labels == ["neg", "pos"] and "a new head" not in said and "new: none" in said


def test_the_runs_tokenizer_frames_a_text_as_training_did(bert_run):
    run = rundir.open(str(bert_run / "run"))
    model, params, tokenizer = run.model(), run.restore_params(), run.tokenizer()
    text = "a lovely superb film"
    ids = tokenizer.encode(text)
    cls, sep = tokenizer.special_id("[CLS]"), tokenizer.special_id("[SEP]")
    assert ids.tolist() == [cls, *tokenizer.pieces(text).tolist(), sep]
    assert run.tokenizer(framed=False).encode(text).tolist() == ids[1:-1].tolist()
    logits = model.apply({"params": params}, ids[None])["logits"]
    (predicted,) = classifier.Classifier(run)([text])
    probabilities = np.asarray(jax.nn.softmax(logits[0]))
    assert [predicted["probabilities"][name] for name in run.labels] == pytest.approx(probabilities, abs=1e-5)


@pytest.mark.slow
def test_predict_and_evaluate_commands_on_a_bert_classifier(bert_run, tmp_path):
    (tmp_path / "new.txt").write_text("a great film\n\nan awful tedious film\n")
    out = cli("predict", "--workdir", str(bert_run / "run"), "--input", str(tmp_path / "new.txt"), "--top_k", "1")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line["input"] for line in lines] == ["a great film", "an awful tedious film"]
    assert all(len(line["probabilities"]) == 1 for line in lines)
    out = cli("evaluate", "--workdir", str(bert_run / "run"), "--step", "2",
              f"--config.data.eval_path={bert_run / 'eval.tsv'}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("step 2: eval/loss ")
    out = cli("evaluate", "--workdir", str(bert_run / "run"), "--config.data.eval_pth=x")
    assert (out.returncode, out.stderr.strip()) == (2, "error: unknown config key data.eval_pth; did you mean "
                                                       "data.eval_path?")


@pytest.mark.slow
def test_token_classifier_evaluates_and_labels_each_word(tmp_path):
    sentence = "x = 1 + y".split()
    tags = ["NAME", "OP", "NUMBER", "OP", "NAME"]
    conll = "".join(f"{w}\t{t}\n" for w, t in zip(sentence, tags)) + "\n"
    for split in ("train", "eval"):
        (tmp_path / f"{split}.conll").write_text(conll * 8)
    config = config_lib.load(os.path.join(REPO, "configs/bert.py:tiny,task=token_classification"), [
        *SMALL_BERT, f"data.train_path={tmp_path / 'train.conll'}", f"data.eval_path={tmp_path / 'eval.conll'}"])
    loop.train(config, str(tmp_path / "run"), devices=ONE)
    assert_evaluates_as_training_did(tmp_path / "run")
    run = rundir.open(str(tmp_path / "run"))
    assert run.labels[:3] == ["NAME", "NUMBER", "OP"]
    (words,) = classifier.Classifier(run)(["x = 1 + y"])
    assert [w["word"] for w in words["words"]] == sentence and words["words_cut"] == 0
    assert all(w["label"] in run.labels for w in words["words"])
    inputs, targets = classifier.read_inputs("token_classification", str(tmp_path / "eval.conll"))
    assert inputs[0] == sentence and targets[0] == tags


@pytest.mark.slow
def test_vit_on_a_folder_evaluates_at_a_step_and_predicts_a_folder_of_new_images(tmp_path):
    rng = np.random.default_rng(0)
    colours = {"blue": (30, 30, 200), "red": (200, 30, 30)}
    for name, colour in colours.items():
        for i in range(8):
            (tmp_path / "images" / name).mkdir(parents=True, exist_ok=True)
            pixels = np.clip(np.array(colour) + rng.normal(0, 20, (12, 12, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(tmp_path / "images" / name / f"{i}.png")
        (tmp_path / "new").mkdir(exist_ok=True)
        Image.fromarray(np.full((20, 16, 3), colour, np.uint8)).save(tmp_path / "new" / f"{name}.png")
    config = config_lib.load(os.path.join(REPO, "configs/vit.py:tiny"), [
        *SMALL_VIT, f"data.source={tmp_path / 'images'}", "data.batch_size=8", "model.channels=3",
        "model.num_classes=2", "data.workers=0"])
    loop.train(config, str(tmp_path / "run"), devices=ONE)
    assert_evaluates_as_training_did(tmp_path / "run", step=2)
    run = rundir.open(str(tmp_path / "run"))
    assert run.labels == ["blue", "red"]
    paths, _ = classifier.read_inputs("image_classification", str(tmp_path / "new"))
    assert [os.path.basename(p) for p in paths] == ["blue.png", "red.png"]
    predictions = classifier.Classifier(run, top_k=1)(paths)
    assert all(list(p["probabilities"]) == [p["label"]] for p in predictions)
    pixels = np.asarray(Image.open(paths[0]))
    classify = classifier.Classifier(run)
    assert classify([pixels]) == classify(paths[:1])  # an array reads as its file does

    shutil.copytree(tmp_path / "images" / "red", tmp_path / "reds" / "red")  # one class: the run's id 1, not 0
    _, held = folders.index_folder(str(tmp_path / "reds"), 0.5, names=run.labels)
    reds = [str(tmp_path / "reds" / p) for p in held["test"][0]]
    assert held["test"][1] == [1] * len(reds)
    called_red = np.mean([p["label"] == "red" for p in classifier.Classifier(run)(reds)])
    _, scored = evaluation.evaluate_run(str(run.path), overrides={"data.source": str(tmp_path / "reds"),
                                                                  "data.test_fraction": "0.5"}, devices=ONE)
    assert scored["eval/accuracy"] == pytest.approx(called_red)
    (tmp_path / "reds" / "green").mkdir()
    with pytest.raises(ValueError, match=r"reds: class folders green are not among the run's classes \(blue, red\)"):
        folders.index_folder(str(tmp_path / "reds"), 0.5, names=run.labels)


@pytest.mark.slow
def test_gpt_evaluates_another_source_and_refuses_to_classify(tmp_path, small_gpt_config, corpus):
    loop.train(small_gpt_config(), str(tmp_path / "run"), devices=ONE)
    run = tmp_path / "run"
    record = (run / "data.json").read_text()
    assert_evaluates_as_training_did(run, step=3)
    _, other = evaluation.evaluate_run(str(run), overrides={"data.source": corpus}, devices=ONE)
    assert np.isfinite(other["eval/loss"]) and other["eval/loss"] != eval_records(run)[6]["eval/loss"]
    assert (run / "data.json").read_text() == record
    with pytest.raises(ValueError, match="gpt models do not classify: generate with python -m transformer.generate"):
        classifier.Classifier(rundir.open(str(run)))
    assert rundir.open(str(run)).labels is None

    converted = tmp_path / "converted"  # weights only, at step 0, as transformer.convert writes them
    converted.mkdir()
    shutil.copy(run / "config.json", converted)
    shutil.copy(run / "tokenizer_config.json", converted)
    ckpt = rundir.open(str(converted)).checkpointer()
    ckpt.save_params(rundir.open(str(run)).restore_params(6))
    ckpt.wait()
    ckpt.close()
    shutil.copytree(run / "store", converted / "store")
    _, metrics = evaluation.evaluate_run(str(converted), devices=ONE)
    assert metrics == pytest.approx(eval_records(run)[6], rel=1e-5)


@pytest.mark.slow
def test_encdec_evaluates_as_it_trained(tmp_path):
    write_pairs(tmp_path / "train.tsv", 64, 0)
    write_pairs(tmp_path / "eval.tsv", 16, 1)
    config = config_lib.load(os.path.join(REPO, "configs/encdec.py:tiny"), [
        *SMALL_ENCDEC, f"data.train_path={tmp_path / 'train.tsv'}", f"data.eval_path={tmp_path / 'eval.tsv'}"])
    loop.train(config, str(tmp_path / "run"), devices=ONE)
    assert_evaluates_as_training_did(tmp_path / "run")
    with pytest.raises(ValueError, match="encdec models do not classify: generate .* --input TEXT"):
        classifier.Classifier(rundir.open(str(tmp_path / "run")))
