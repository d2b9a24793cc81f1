"""Runs out to transformers (`python -m transformer.convert --workdir RUN --to_hf OUT`): a BERT classifier
fine-tuned here, a byte-level GPT, a converted T5, a sinusoidal encoder-decoder trained here (as Marian) and a
mean-pooling ViT (as I-JEPA) load with from_pretrained and AutoTokenizer, encode as the
run does and give its logits; what no transformers class expresses fails in one line."""

import math
import os
import subprocess
import sys

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest
import transformers
from conftest import FAST_COMPILES, REPO, write_pairs
from PIL import Image
from test_bert import SMALL_BERT
from test_encdec import SMALL as SMALL_ENCDEC
from test_evaluate import ONE, write_reviews
from test_hf import TOL, perturbed, t5
from test_hf_tokenizers import json_module_source, t5_spiece, varied_strings

from transformer import config as config_lib
from transformer import models, rundir
from transformer.data.images import host_views, normalisation
from transformer.data.text import tokenizers
from transformer.inference import classifier, decoding, sampling
from transformer.interop import hf, hf_export, hf_import
from transformer.interop.hf_families import Unsupported
from transformer.training import loop, shapes

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch


def weights_only_run(workdir, config, noise: float = 0.0) -> None:
    """A run directory of `config` holding its initial params at step 0 (as a converted run does), each
    weight plus N(0, noise^2) noise (so that no zero-initialised head gives zeros whatever its input)."""
    model = models.build(config.model)
    inputs = [np.zeros(x.shape, x.dtype) for x in models.family(config.model.family).example_inputs(model)]
    params = nn.unbox(model.init(jax.random.key(0), *inputs)["params"])
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: x + noise * rng.normal(size=x.shape).astype(x.dtype), params)
    run = rundir.RunDir(str(workdir))
    run.write_config(config)
    ckpt = run.checkpointer()
    ckpt.save_params(params)
    ckpt.wait()
    ckpt.close()


def ours_and_theirs(workdir, out, auto_class):
    run = rundir.open(str(workdir))
    theirs = getattr(transformers, auto_class).from_pretrained(out, attn_implementation="eager").eval()
    return run, run.model(), run.restore_params(), theirs, transformers.AutoTokenizer.from_pretrained(out)


def test_a_finetuned_bert_classifier_exports_with_its_labels_and_framing(tmp_path):
    write_reviews(tmp_path / "train.tsv", 48, 0)
    config = config_lib.load(os.path.join(REPO, "configs/bert.py:tiny,task=sequence_classification"), [
        *SMALL_BERT, "model.num_labels=2", "train.steps=2", f"data.train_path={tmp_path / 'train.tsv'}",
        f"data.eval_path={tmp_path / 'train.tsv'}"])
    loop.train(config, str(tmp_path / "run"), devices=ONE)
    done = hf_export.export_run(str(tmp_path / "run"), str(tmp_path / "out"))
    assert done["class"] == "BertForSequenceClassification" and done["step"] == 2
    run, model, params, theirs, tok = ours_and_theirs(tmp_path / "run", tmp_path / "out",
                                                      "AutoModelForSequenceClassification")
    assert theirs.config.id2label == {0: "neg", 1: "pos"} and theirs.config.pad_token_id == 0
    texts = ["a superb film", "an awful, tedious film"]
    batch = tok(texts, padding=True, return_tensors="np")
    framed = [run.tokenizer().encode(t).tolist() for t in texts]  # [CLS] ... [SEP], as transformers frames it
    assert [row[mask.astype(bool)].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])] == framed
    ours = model.apply({"params": params}, batch["input_ids"], batch["token_type_ids"],
                       batch["attention_mask"].astype(bool))["logits"]
    with torch.no_grad():
        logits = theirs(**{k: torch.tensor(v) for k, v in batch.items()}).logits.numpy()
    assert np.abs(np.asarray(ours) - logits).max() <= TOL
    probabilities = classifier.Classifier(run)(texts)
    assert [max(p["probabilities"], key=p["probabilities"].get) for p in probabilities] == [
        theirs.config.id2label[i] for i in logits.argmax(-1)]


def test_a_byte_level_gpt_exports_a_tokenizer_of_its_bytes(tmp_path, small_gpt_config):
    config = small_gpt_config()
    weights_only_run(tmp_path / "run", config)
    tokenizers.ByteTokenizer().save(str(tmp_path / "run"))
    hf_export.export_run(str(tmp_path / "run"), str(tmp_path / "out"))
    run, model, params, theirs, tok = ours_and_theirs(tmp_path / "run", tmp_path / "out", "AutoModelForCausalLM")
    for text in varied_strings():
        ids = tok(text)["input_ids"]
        assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text, text
    assert theirs.config.eos_token_id is None and theirs.config.bos_token_id is None
    tokens = np.asarray([list(b"def f(x):\n    return x")], np.int32)
    with torch.no_grad():
        logits = theirs(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(np.asarray(model.apply({"params": params}, tokens)) - logits).max() <= TOL


def test_save_pretrained_from_python_writes_the_files_convert_writes(tmp_path):
    config = config_lib.load(os.path.join(REPO, "configs/bert.py:tiny,task=sequence_classification"), [
        *SMALL_BERT, "model.num_labels=3", "data.tokenizer=wordpiece"])
    weights_only_run(tmp_path / "run", config, noise=0.1)
    tokenizer = tokenizers.train_wordpiece([open(json_module_source()).read()], 400)
    tokenizer.save(str(tmp_path / "run"))
    (tmp_path / "run" / "labels.json").write_text('["c", "a", "b"]')
    hf_export.export_run(str(tmp_path / "run"), str(tmp_path / "convert"))
    params = rundir.open(str(tmp_path / "run")).restore_params()
    hf.save_pretrained(params, config, str(tmp_path / "python"), tokenizer, labels=["c", "a", "b"])
    files = sorted(os.listdir(tmp_path / "convert"))
    assert files == sorted(os.listdir(tmp_path / "python")) and "tokenizer.json" in files
    for name in files:
        assert (tmp_path / "python" / name).read_bytes() == (tmp_path / "convert" / name).read_bytes(), name


def test_a_converted_t5_exports_its_sentencepiece_tokenizer_and_ids(tmp_path):
    t5_spiece([open(json_module_source()).read(), "héllo wörld naïve café"] * 3, tmp_path / "hf")
    vocab = len(transformers.AutoTokenizer.from_pretrained(tmp_path / "hf"))
    torch.manual_seed(0)
    perturbed(t5("T5ForConditionalGeneration", vocab_size=vocab)).save_pretrained(tmp_path / "hf")
    hf_import.convert(str(tmp_path / "hf"), str(tmp_path / "run"), configs=os.path.join(REPO, "configs"))
    hf_export.export_run(str(tmp_path / "run"), str(tmp_path / "out"))
    run, model, params, theirs, tok = ours_and_theirs(tmp_path / "run", tmp_path / "out",
                                                      "AutoModelForSeq2SeqLM")
    ours_tok = run.tokenizer()
    text = "def scan_once(string, idx): héllo"
    assert tok(text)["input_ids"] == [*ours_tok.encode(text).tolist(), ours_tok.special_id("[EOS]")]
    assert tok.convert_tokens_to_ids("<extra_id_0>") == ours_tok.special_id("<extra_id_0>")
    assert (theirs.config.decoder_start_token_id, theirs.config.eos_token_id) == (0, 1)
    src = np.asarray([tok(text)["input_ids"]], np.int32)
    tgt = np.asarray([[0, 7, 9, 4]], np.int32)
    with torch.no_grad():
        logits = theirs(input_ids=torch.tensor(src, dtype=torch.long),
                        decoder_input_ids=torch.tensor(tgt, dtype=torch.long)).logits.numpy()
    ours = model.apply({"params": params}, src, tgt, np.ones_like(src, bool))
    assert np.abs(np.asarray(ours) - logits).max() <= TOL


@pytest.mark.slow  # about 30 s: most of it compiling the training and eval steps
def test_a_trained_sinusoidal_encoder_decoder_exports_as_marian_with_its_logits_and_greedy_outputs(tmp_path):
    write_pairs(tmp_path / "pairs.tsv", 64, 0)
    config = config_lib.load(os.path.join(REPO, "configs/encdec.py:tiny"), [
        *SMALL_ENCDEC, "model.norm_epsilon=1e-5", "model.d_model=30", "model.num_heads=3", "model.num_decoder_layers=2",
        "optim.lr=1e-2", "train.steps=24", "train.eval_every=24", "train.checkpoint_every=24", "data.eval_batches=1",
        f"data.train_path={tmp_path / 'pairs.tsv'}", f"data.eval_path={tmp_path / 'pairs.tsv'}"])
    loop.train(config, str(tmp_path / "run"), devices=ONE)
    done = hf_export.export_run(str(tmp_path / "run"), str(tmp_path / "out"))
    assert (done["class"], done["step"]) == ("MarianMTModel", 24)
    run, model, params, theirs, tok = ours_and_theirs(tmp_path / "run", tmp_path / "out", "AutoModelForSeq2SeqLM")
    ours_tok = run.tokenizer()
    texts = ["alpha beta gamma delta", "omega kappa omega beta", "delta alpha"]
    batch = tok(texts, padding=True, return_tensors="np")
    assert [row[m.astype(bool)].tolist() for row, m in zip(batch["input_ids"], batch["attention_mask"])] == [
        ours_tok.encode(t).tolist() for t in texts]
    bos, eos = ours_tok.special_id("[BOS]"), ours_tok.special_id("[EOS]")
    assert (theirs.config.decoder_start_token_id, theirs.config.eos_token_id) == (bos, eos)
    src, valid = batch["input_ids"].astype(np.int32), batch["attention_mask"].astype(bool)
    tgt = np.asarray([[bos, 7, 9, 4, 11, 5]] * len(texts), np.int32)
    with torch.no_grad():
        logits = theirs(input_ids=torch.tensor(src, dtype=torch.long), attention_mask=torch.tensor(valid),
                        decoder_input_ids=torch.tensor(tgt, dtype=torch.long)).logits.numpy()
    ours = np.asarray(model.apply({"params": params}, src, tgt, valid))
    assert np.abs(ours).max() > 1.0 and np.abs(ours - logits).max() <= TOL
    max_len = 8
    with torch.no_grad():
        generated = theirs.generate(input_ids=torch.tensor(src, dtype=torch.long), attention_mask=torch.tensor(valid),
                                    max_new_tokens=max_len, do_sample=False, num_beams=1).numpy()
    theirs_texts = [tok.decode(sampling.until_stop(row[1:], (eos,)), skip_special_tokens=True) for row in generated]
    ours_texts = decoding.translate(model, params, ours_tok, texts, max_len=max_len)
    assert ours_texts == theirs_texts and any(ours_texts), (ours_texts, theirs_texts)


@pytest.mark.parametrize("channels, crop_fraction, pool, cls", [  # an uncropped view: the IJepa case's
    (1, 1.0, "mean", "IJepaForImageClassification"), (3, 0.75, "cls", "ViTForImageClassification")])
def test_a_vit_exports_an_image_processor_that_views_and_normalises_as_the_run_does(tmp_path, channels,
                                                                                    crop_fraction, pool, cls):
    config = config_lib.load(os.path.join(REPO, "configs/vit.py:tiny"), [
        f"model.channels={channels}", "model.image_size=8", "model.num_classes=3", f"model.pool={pool}",
        f"data.crop_fraction={crop_fraction}"])
    weights_only_run(tmp_path / "run", config, noise=0.5)
    mean, std = np.asarray([100.0, 120.0, 90.0][:channels]), np.asarray([60.0, 50.0, 70.0][:channels])
    normalisation.save_statistics(str(tmp_path / "run"), mean, std, "a test's")
    out = command(f"--workdir={tmp_path / 'run'}", f"--to_hf={tmp_path / 'out'}")
    assert out.stdout.splitlines()[-1] == (f"load:      transformers.{cls}.from_pretrained("
                                           f"{str(tmp_path / 'out')!r}), transformers.AutoImageProcessor."
                                           f"from_pretrained({str(tmp_path / 'out')!r})"), out.stderr[-2000:]
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "out")
    theirs = transformers.AutoModelForImageClassification.from_pretrained(tmp_path / "out").eval()
    run = rundir.open(str(tmp_path / "run"))
    recipe = host_views.Recipe.of(run.config)
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (side, side, channels), dtype=np.uint8) for side in (8, 8, 20)]
    views = np.stack([host_views.eval_view(x, recipe) for x in images])  # [3, 8, 8, C]
    ours = run.model().apply({"params": run.restore_params()}, normalisation.normalise(views, mean, std))
    pixels = processor([Image.fromarray(x.squeeze(-1) if channels == 1 else x) for x in images],
                       return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        logits = theirs(pixel_values=pixels).logits.numpy()
    assert np.abs(np.asarray(ours)).max() > 0.1 and np.abs(np.asarray(ours) - logits).max() <= TOL
    back = command(f"--hf_dir={tmp_path / 'out'}", f"--workdir={tmp_path / 'back'}")
    data = rundir.open(str(tmp_path / "back")).config.data  # what predict normalises and crops by
    assert back.returncode == 0 and np.allclose(data.mean, mean) and np.allclose(data.std, std), back.stderr[-2000:]
    assert math.floor(8 / data.crop_fraction) == math.floor(8 / crop_fraction)  # the same eval view


def command(*args) -> subprocess.CompletedProcess:
    env = {**{**os.environ, "XLA_FLAGS": FAST_COMPILES}, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "transformer.convert", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("family, overrides, match", [
    ("vit", dict(pool="mean", head="none", pooler=True),
     "config.model.pooler=True has no equivalent in transformers' I-JEPA"),
    ("gpt", dict(num_experts=4), "config.model.num_experts=4 has no equivalent in transformers' gpt2: a mixture "
     "exports as Mixtral or Qwen3-MoE, which need model.positions='rotary' and model.norm='rmsnorm'$"),
    ("encdec", dict(positions="relative", norm="rmsnorm", norm_placement="pre", use_bias=False, head="none"),
     "config.model.head='none' has no equivalent in transformers' t5 \\(its heads: lm, encoder\\)"),
    ("encdec", dict(positions="learned", head="encoder"),
     "config.model.head='encoder' has no equivalent in transformers' bart"),
    ("encdec", dict(head="none"), "config.model.head='none' has no equivalent in transformers' marian"),
    ("encdec", dict(norm_epsilon=1e-5, norm_placement="pre"),
     "config.model.norm_placement='pre' has no equivalent in transformers' Marian \\(needs 'post'\\)$"),
])
def test_a_model_no_transformers_class_expresses_fails_to_export_naming_why(tmp_path, family, overrides, match):
    m = ml_collections.ConfigDict({**models.family(family).model_config("tiny"), **overrides})
    with pytest.raises(Unsupported, match=match):
        hf.save_pretrained({}, m, str(tmp_path))


def test_the_export_command_fails_in_one_line(tmp_path):
    config = shapes.resolved(config_lib.load(os.path.join(REPO, "configs/vit.py:tiny"), ["model.norm=rmsnorm"]))
    weights_only_run(tmp_path / "vit", config)
    for args, expected in [
        ([f"--workdir={tmp_path / 'vit'}"], "error: give --hf_dir DIR (a Hugging Face model into the run --workdir) "
                                             "or --to_hf DIR (the run --workdir out to transformers), one of them"),
        ([f"--workdir={tmp_path / 'vit'}", f"--to_hf={tmp_path / 'out'}"],
         "error: config.model.norm='rmsnorm' has no equivalent in transformers' I-JEPA (needs 'layernorm')"),
    ]:
        out = command(*args)
        assert (out.returncode, out.stderr.strip().splitlines()[-1]) == (2, expected), out.stderr
    with pytest.raises(FileNotFoundError, match="config.json not found: is --workdir a run directory"):
        hf_export.export_run(str(tmp_path / "none"), str(tmp_path / "out"))
    with pytest.raises(ValueError, match=f"--step=3: {tmp_path / 'vit'} holds checkpoints of steps 0$"):
        hf_export.export_run(str(tmp_path / "vit"), str(tmp_path / "out"), step=3)
    with pytest.raises(ValueError, match="already holds a model; choose a new --to_hf"):
        hf_export.export_run(str(tmp_path / "vit"), str(tmp_path / "vit"))


# preset -> the transformers class it exports as, or the config.model key none expresses (README.md's families table
# says the same; tests/test_docs.py checks it)
PRESET_EXPORTS = {
    "gpt.py:tiny": "GPT2LMHeadModel", "gpt.py:gpt2-small": "GPT2LMHeadModel", "gpt.py:gpt3-175b": "GPT2LMHeadModel",
    "gpt.py:llama-tiny": "LlamaForCausalLM", "gpt.py:llama3-8b": "LlamaForCausalLM",
    "gpt.py:mistral-7b": "MistralForCausalLM", "gpt.py:mixtral-8x7b": "MixtralForCausalLM",
    "gpt.py:qwen3-0.6b": "Qwen3ForCausalLM", "gpt.py:qwen3-30b-a3b": "Qwen3MoeForCausalLM",
    "gpt.py:tiny-moe": "config.model.num_experts=8", "gpt.py:tiny-long": "config.model.activation='gelu'",
    "bert.py:tiny": "BertForMaskedLM", "bert.py:tiny,task=sequence_classification": "BertForSequenceClassification",
    "bert.py:tiny,task=token_classification": "BertForTokenClassification",
    "vit.py:s16": "ViTForImageClassification", "vit.py:tiny": "IJepaForImageClassification",
    "encdec.py:t5-small": "T5ForConditionalGeneration", "encdec.py:tiny": "MarianMTModel",
    "encdec.py:vaswani-base": "MarianMTModel",
    "encdec.py:tiny,model.norm_epsilon=1e-6": "config.model.norm_epsilon=1e-06",
}


@pytest.mark.parametrize("spec, expected", PRESET_EXPORTS.items())
def test_which_presets_export_as_which_class_is_known_before_training(spec, expected):
    model = config_lib.load(os.path.join(REPO, "configs", spec)).model
    with model.unlocked():
        for key, value in dict(vocab_size=256, num_labels=2, num_classes=10, channels=1, image_size=8).items():
            if key in model and not model[key]:
                model[key] = value
    line = hf.export_line(model)
    if expected.startswith("config."):
        assert line.startswith("export: no transformers class expresses this run, so convert --to_hf will refuse "
                               f"it: {expected}"), line
    else:
        assert line == f"export: convert --to_hf writes this run as transformers' {expected}"


def test_a_conversion_finds_the_config_files_wherever_it_runs(tmp_path, monkeypatch):
    model = config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny"), ["model.vocab_size=300"]).model
    monkeypatch.chdir(tmp_path)  # outside the repository
    config = hf.run_config(model)
    assert "data" in config and config.data.tokenizer == "hf" and config_lib.CONFIGS == os.path.join(REPO, "configs")
    assert hf_import.finetune_command(config, "run").startswith(
        f"python -m transformer.train --config {REPO}/configs/gpt.py")
