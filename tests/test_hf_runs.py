"""Hugging Face checkpoints as runs: a converted model generates, fine-tunes and translates from the
command line; .bin, sharded and bfloat16 checkpoints load in their dtype without reading twice their size."""

import copy
import json
import os
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest
import transformers
from conftest import FAST_COMPILES, REPO
from test_hf import LLAMA3_ROPE, TOL, bert, decoder, gpt2, perturbed, t5, token_batch
from test_hf_tokenizers import json_module_source, t5_spiece, tokenizer_dirs

from transformer import models
from transformer.interop import hf

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch


def hf_dir_with_tokenizer(tmp_path, make_model) -> tuple:
    """A transformers model directory holding a model and the byte-level BPE tokenizer of `tokenizer_dirs`."""
    (tmp_path / "tok").mkdir()
    name, directory, theirs_tok = next(d for d in tokenizer_dirs(tmp_path / "tok") if d[0] == "tokenizer_json")
    torch.manual_seed(0)
    theirs = perturbed(make_model(len(theirs_tok)))
    theirs.save_pretrained(tmp_path / "hf")
    theirs_tok.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", theirs, theirs_tok


def run_printed(line: str, *extra: str, cwd) -> str:
    """Runs a command convert printed (after its 'name:'), with `extra` arguments appended; its stdout."""
    args = shlex.split(line.partition(":")[2])
    assert args[:2] == ["python", "-m"], line
    out = subprocess.run([sys.executable, *args[1:], *extra], cwd=cwd, capture_output=True, text=True,
                         env={**{**os.environ, "XLA_FLAGS": FAST_COMPILES}, "PYTHONPATH": REPO})
    assert out.returncode == 0, (line, out.stderr[-3000:])
    return out.stdout


@pytest.mark.slow
def test_a_converted_gpt2_runs_the_printed_commands_and_its_finetuned_run_exports_back(tmp_path):
    """convert's printed generate, evaluate and fine-tune commands run as printed (a few small settings
    appended), and the fine-tuned run exports to a directory transformers loads with its tokenizer."""
    import sysconfig

    from transformer import config as config_lib
    from transformer import rundir
    from transformer.inference import engine, sampling
    from transformer.training import checks, loop

    make = lambda vocab: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=vocab, n_positions=64, bos_token_id=0, eos_token_id=0))
    hf_dir, theirs, theirs_tok = hf_dir_with_tokenizer(tmp_path, make)
    printed = run_printed(f"convert: python -m transformer.convert --hf_dir={hf_dir} --workdir=run",
                          cwd=tmp_path).splitlines()  # outside the repository: its configs/ found all the same
    lines = {line.partition(":")[0]: line for line in printed[1:]}
    assert list(lines) == ["generate", "evaluate", "fine-tune"], printed
    assert f"--config {REPO}/configs/gpt.py:gpt2-small" in lines["fine-tune"]
    converted = rundir.open(str(tmp_path / "run"))
    model, params, tokenizer = converted.model(), converted.restore_params(), converted.tokenizer()
    text = "def decode(self, s):\n    return  s  # héllo"
    ids = tokenizer.encode(text)
    assert ids.tolist() == theirs_tok(text)["input_ids"]
    with torch.no_grad():
        expected = theirs(torch.tensor(ids[None], dtype=torch.long)).logits.numpy()
    assert np.abs(np.asarray(model.apply({"params": params}, ids[None])) - expected).max() <= TOL
    assert engine.complete(model, params, tokenizer, "def ",
        sampling.Sampling(max_new_tokens=5))[0]

    assert run_printed(lines["generate"], "--max_new_tokens=4", cwd=tmp_path).startswith("TEXT")
    small = [f"--config.data.source={sysconfig.get_paths()['stdlib']}/json/*.py", "--config.data.batch_size=2",
             "--config.data.eval_batches=1", "--config.data.eval_fraction=0.3"]
    assert run_printed(lines["evaluate"], *small, cwd=tmp_path).startswith("step 0: eval/loss ")
    assert {"--config.optim.lr=5e-05", "--config.optim.warmup_steps=100"} <= set(shlex.split(lines["fine-tune"]))
    run_printed(lines["fine-tune"], *small, "--config.train.steps=2", "--config.train.eval_every=2",
                "--config.train.sample_tokens=0", cwd=tmp_path)
    finetuned = rundir.open(str(tmp_path / "NEW_RUN_DIR"))
    assert finetuned.latest_step == 2
    tuned = finetuned.restore_params()
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-4), tuned, params)  # 2 steps at lr <= 5e-5

    out = run_printed("export: python -m transformer.convert --workdir=NEW_RUN_DIR --to_hf=hf_out", cwd=tmp_path)
    load = out.splitlines()[-1].partition(":")[2].strip()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        back, back_tok = eval(load, {"transformers": transformers})
    assert (back.config.bos_token_id, back.config.eos_token_id) == (theirs_tok.bos_token_id, theirs_tok.eos_token_id)
    assert back_tok(text)["input_ids"] == ids.tolist()
    with torch.no_grad():
        exported = back.eval()(torch.tensor(ids[None], dtype=torch.long)).logits.numpy()
    assert np.abs(np.asarray(model.apply({"params": tuned}, ids[None])) - exported).max() <= TOL

    flags = [a[len("--config."):] for a in [*shlex.split(lines["fine-tune"]), *small] if a.startswith("--config.")]
    config = config_lib.load(f"{REPO}/configs/gpt.py:gpt2-small", flags)
    with pytest.raises(ValueError, match="holds weights only .* --config.init_from="):
        # training on the converted run itself
        loop.setup(checks.checked(config), str(tmp_path / "run"), jax.devices()[:1])


def test_converted_bart_run_translates(tmp_path):
    from transformer import rundir
    from transformer.inference import decoding
    from transformer.interop import hf_import

    make = lambda vocab: transformers.BartForConditionalGeneration(transformers.BartConfig(
        encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=vocab, max_position_embeddings=32))
    hf_dir, theirs, _ = hf_dir_with_tokenizer(tmp_path, make)
    hf_import.convert(str(hf_dir), str(tmp_path / "run"))
    converted = rundir.open(str(tmp_path / "run"))
    model, params, tokenizer = converted.model(), converted.restore_params(), converted.tokenizer()
    assert tokenizer.special_id("[BOS]") == theirs.config.decoder_start_token_id
    src = tokenizer.encode("def f(x): return x")[None]
    tgt = np.asarray([[theirs.config.decoder_start_token_id, 7, 9]])
    with torch.no_grad():
        expected = theirs(input_ids=torch.tensor(src, dtype=torch.long),
                          decoder_input_ids=torch.tensor(tgt, dtype=torch.long)).logits.numpy()
    ours = model.apply({"params": params}, src, tgt, np.ones_like(src, bool))
    assert np.abs(np.asarray(ours) - expected).max() <= TOL
    assert isinstance(decoding.translate(model, params, tokenizer, ["def f(x): return x"], max_len=6)[0], str)


def test_convert_refuses_an_existing_run(tmp_path):
    from transformer.interop import hf_import

    theirs = perturbed(bert("BertForSequenceClassification"))
    theirs.save_pretrained(tmp_path / "hf")
    out = hf_import.convert(str(tmp_path / "hf"), str(tmp_path / "run"))
    assert out["tokenizer"] is None and models.task_of(out["config"].model) == "sequence_classification"
    with pytest.raises(ValueError, match="already holds a run"):
        hf_import.convert(str(tmp_path / "hf"), str(tmp_path / "run"))


def test_a_converted_classifier_keeps_its_label_names_but_not_transformers_default_ones(tmp_path):
    from transformer import rundir
    from transformer.interop import hf_import
    from transformer.training.tasks import classification

    names = ["joy", "anger", "fear", "love", "surprise"]  # not sorted: each id keeps its name
    perturbed(bert("BertForSequenceClassification", id2label=dict(enumerate(names)))).save_pretrained(tmp_path / "hf")
    perturbed(bert("BertForSequenceClassification")).save_pretrained(tmp_path / "defaults")  # LABEL_0 ...
    for name in ("hf", "defaults"):
        hf_import.convert(str(tmp_path / name), str(tmp_path / f"{name}_run"))
    assert rundir.open(str(tmp_path / "hf_run")).labels == names
    assert rundir.open(str(tmp_path / "defaults_run")).labels == ["0", "1", "2", "3", "4"]
    with pytest.raises(ValueError, match=r"^EVAL.tsv: labels neg are not among the run's labels \['joy', "):
        classification.label_ids(["joy", "neg"], names, "EVAL.tsv")


def test_a_converted_classifier_names_its_labelled_data_and_a_headless_model_gets_a_head(tmp_path, capsys):
    """The printed evaluate and fine-tune commands of a BERT classifier run once its data is named (data of
    other labels: evaluate fails in one line, fine-tuning starts a new head); a model without a head
    (GPT2Model) is offered no generate or evaluate, and fine-tunes with the config's head."""
    from test_evaluate import ONE, write_reviews

    from transformer import config as config_lib
    from transformer.interop import hf_import
    from transformer.training import evaluation, loop

    (tmp_path / "tok").mkdir()
    hf_dir = next(d for name, d, _ in tokenizer_dirs(tmp_path / "tok") if name == "vocab_txt_uncased")
    vocab = len(transformers.AutoTokenizer.from_pretrained(hf_dir))
    sizes = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=vocab,
                 max_position_embeddings=32)
    perturbed(transformers.BertForSequenceClassification(transformers.BertConfig(**sizes))).save_pretrained(hf_dir)
    configs = os.path.join(REPO, "configs")
    out = hf_import.convert(str(hf_dir), str(tmp_path / "run"), configs=configs)
    lines = hf_import.import_commands(out["config"], str(tmp_path / "run"), configs, out["tokenizer"])
    assert [line.partition(":")[0] for line in lines] == ["evaluate", "fine-tune", "data"], lines
    for name in ("TRAIN.tsv", "EVAL.tsv"):
        write_reviews(tmp_path / name, 16, 0)
    named = lambda line: [a.replace("TRAIN.tsv", str(tmp_path / "TRAIN.tsv")).replace("EVAL.tsv", str(
        tmp_path / "EVAL.tsv"))[len("--config."):] for a in shlex.split(line) if a.startswith("--config.")]
    small = ["data.batch_size=8", "data.eval_batches=1"]
    overrides = dict(a.split("=", 1) for a in named(lines[0]) + small)
    assert np.isfinite(evaluation.evaluate_run(str(tmp_path / "run"), overrides=overrides, devices=ONE)[1]["eval/loss"])
    spec = shlex.split(lines[1])[shlex.split(lines[1]).index("--config") + 1]
    config = config_lib.load(spec, named(lines[1]) + small + ["train.steps=1", "train.eval_every=1"])
    assert np.isfinite(loop.train(config, str(tmp_path / "finetune"), devices=ONE)["eval/loss"])
    with open(tmp_path / "four.tsv", "w") as f:  # other labels: a new head, as ignore_mismatched_sizes starts
        f.writelines(f"{'abcd'[i % 4]}\tword{i} film\n" for i in range(16))
    four = {f"data.{k}": str(tmp_path / "four.tsv") for k in ("train_path", "eval_path")}
    with pytest.raises(ValueError, match="four.tsv holds 4 labels .a, b, c, d., more than the model's 2 outputs"):
        evaluation.evaluate_run(str(tmp_path / "run"), overrides={**overrides, **four}, devices=ONE)
    config = config_lib.load(spec, named(lines[1]) + small + ["train.steps=1", "train.eval_every=1"]
                             + [f"{k}={v}" for k, v in four.items()])
    assert np.isfinite(loop.train(config, str(tmp_path / "four"), devices=ONE)["eval/loss"])
    said = capsys.readouterr().err
    assert "a new head (classifier/bias, classifier/kernel start fresh): its head has 2 outputs" in said

    transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=vocab, n_positions=32)
                           ).save_pretrained(tmp_path / "headless")
    for tokenizer_file in hf_dir.glob("*.txt"):
        (tmp_path / "headless" / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    out = hf_import.convert(str(tmp_path / "headless"), str(tmp_path / "headless_run"), configs=configs)
    lines = hf_import.import_commands(out["config"], str(tmp_path / "headless_run"), configs, out["tokenizer"])
    assert [line.partition(":")[0] for line in lines] == ["fine-tune"] and "model.head" not in lines[0], lines


def test_bin_and_sharded_checkpoints_load_and_a_scanned_model_exports(tmp_path):
    from transformer.models import common

    theirs = perturbed(gpt2("GPT2LMHeadModel"))
    theirs.save_pretrained(tmp_path / "bin")  # transformers 5 writes safetensors only: make the older format
    (tmp_path / "bin" / "model.safetensors").unlink()
    torch.save(theirs.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "bin" / "pytorch_model.bin").exists()
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    (_, bin_params, config), (_, sharded_params, _) = (hf.load_pretrained(str(tmp_path / d))
                                                       for d in ("bin", "sharded"))
    jax.tree.map(np.testing.assert_array_equal, bin_params, sharded_params)
    copy.deepcopy(theirs).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    _, bf16_params, bf16_config = hf.load_pretrained(str(tmp_path / "bf16"))
    assert bf16_config.model.param_dtype == "bfloat16" and {x.dtype for x in jax.tree.leaves(bf16_params)} == {
        jax.numpy.dtype("bfloat16")}
    _, as_f32, _ = hf.load_pretrained(str(tmp_path / "bf16"), param_dtype="float32")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b, np.float32)), as_f32, bf16_params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-3), bf16_params, bin_params)

    config.unlock()
    config.model.scan_layers = True
    scanned = common.stack_layers(bin_params, "block", config.model.num_layers)
    hf.save_pretrained(scanned, config, str(tmp_path / "out"))
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    tokens, valid = token_batch(101)
    with torch.no_grad():
        a, b = (m(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy() for m in (theirs, back))
    assert np.abs(a - b).max() <= TOL


@pytest.mark.parametrize("cls, extra", [("LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
                                        ("MistralForCausalLM", dict(sliding_window=8)),
                                        ("Qwen3ForCausalLM", dict(head_dim=16)),
                                        ("MixtralForCausalLM", dict(sliding_window=8)),
                                        ("Qwen3MoeForCausalLM", dict(norm_topk_prob=True, mlp_only_layers=[0]))])
def test_a_converted_decoder_generates_transformers_greedy_tokens_with_its_kv_cache(tmp_path, cls, extra):
    from transformer.inference import decoding, engine, sampling
    torch.manual_seed(0)
    theirs = perturbed(decoder(cls, **extra), seed=1, scale=0.3)  # large weights: a varied greedy sequence
    theirs.save_pretrained(tmp_path / "hf")
    model, params, _ = hf.load_pretrained(str(tmp_path / "hf"))
    prompt = np.random.default_rng(0).integers(3, 101, (1, 6))
    with torch.no_grad():
        out = theirs.generate(torch.tensor(prompt), max_new_tokens=32, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    sequence = out.sequences[0, 6:].numpy()
    assert len(set(sequence.tolist())) >= 8  # past the window (8) for Mistral, and not a repeated token
    their_logits = np.stack([s[0].numpy() for s in out.logits])  # [32, V]
    cached = decoding.sized_cache(model, 6 + 32)
    logits, variables = cached.apply({"params": params, "cache": decoding.init_cache(cached, 1)}, prompt,
                                     decode=True, mutable=["cache"])
    ours = [np.asarray(logits[0, -1])]
    for token in sequence[:-1]:
        logits, variables = cached.apply({"params": params, "cache": variables["cache"]}, np.array([[token]]),
                                         decode=True, mutable=["cache"])
        ours.append(np.asarray(logits[0, -1]))
    assert np.abs(np.stack(ours) - their_logits).max() <= TOL
    new = np.array(engine.new_tokens(model, params, np.asarray(prompt).tolist(),
        sampling.Sampling(max_new_tokens=32)))
    np.testing.assert_array_equal(np.asarray(new[0]), sequence)


LOAD_AND_MEASURE = """
import json, re, sys
import jax, numpy as np
from transformer.interop import hf
status = lambda key: int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark restarts from the resident memory now
base = status("VmRSS")
model, params, config = hf.load_pretrained(sys.argv[1])
peak = status("VmHWM")
leaves = jax.tree.leaves(params)
print(json.dumps({"added_mib": peak - base, "dtypes": sorted({str(x.dtype) for x in leaves}),
                  "params": sum(x.size for x in leaves), "param_dtype": config.model.param_dtype,
                  "q0": np.asarray(params["block_0"]["self_attn"]["query"]["kernel"], np.float32)[:2, 0, :4].tolist()}))
"""


@pytest.mark.slow
def test_a_sharded_bfloat16_checkpoint_loads_in_its_dtype_within_twice_its_size(tmp_path):
    import subprocess
    import sys

    config = transformers.LlamaConfig(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                                      num_key_value_heads=4, intermediate_size=2048, vocab_size=32000)
    theirs = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="60MB")
    shards = sorted(p for p in (tmp_path / "hf").iterdir() if p.suffix == ".safetensors")
    size_mib = sum(p.stat().st_size for p in shards) / 2**20
    assert len(shards) >= 4 and size_mib > 200
    out = subprocess.run([sys.executable, "-c", LOAD_AND_MEASURE, str(tmp_path / "hf")], capture_output=True,
                         text=True, check=True, cwd=REPO)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["dtypes"] == ["bfloat16"] and result["param_dtype"] == "bfloat16"
    assert result["params"] == sum(p.numel() for p in theirs.parameters())
    q = theirs.model.layers[0].self_attn.q_proj.weight.detach().float().numpy().T.reshape(768, 12, 64)[:2, 0, :4]
    np.testing.assert_array_equal(result["q0"], q)
    assert result["added_mib"] < 2 * size_mib, (result["added_mib"], size_mib)


@pytest.mark.parametrize("extra, seed, embedding_scale", [
    ({}, 2, 1.0), (dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False), 1, 0.1)], ids=["v1.0", "v1.1"])
def test_a_converted_t5_decodes_transformers_greedy_tokens_with_its_kv_cache(tmp_path, extra, seed, embedding_scale):
    """Weights perturbed enough for a varied greedy sequence, logits kept near 1 (v1.1's unscaled output
    through a smaller embedding): float32's error grows with the activations' size."""
    from transformer.inference import decoding
    torch.manual_seed(0)
    # equal depths: transformers' generate sizes its cache by num_layers
    theirs = perturbed(t5("T5ForConditionalGeneration", num_decoder_layers=2, **extra), seed=seed, scale=0.5)
    with torch.no_grad():
        theirs.shared.weight.mul_(embedding_scale)
    theirs.save_pretrained(tmp_path / "hf")
    model, params, config = hf.load_pretrained(str(tmp_path / "hf"))
    src = np.r_[np.random.default_rng(0).integers(3, 97, 9), 1][None]  # ... </s>, T5's convention
    with torch.no_grad():
        out = theirs.generate(torch.tensor(src), max_new_tokens=24, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, eos_token_id=None)
    sequence = out.sequences[0, 1:].numpy()  # after the start token, 0 (T5's pad)
    assert out.sequences[0, 0] == 0 and len(set(sequence.tolist())) >= 6
    valid = np.ones_like(src, bool)
    cached = decoding.sized_cache(model, 25)
    encoded = cached.apply({"params": params}, src, valid, method="encode")
    logits, cache = decoding.decode_step(cached, params, None, np.zeros(1, np.int32), encoded, valid)
    ours = [np.asarray(logits[0])]
    for token in sequence[:-1]:
        logits, cache = decoding.decode_step(cached, params, cache, np.array([token], np.int32), encoded, valid)
        ours.append(np.asarray(logits[0]))
    assert np.abs(np.stack(ours) - np.stack([s[0].numpy() for s in out.logits])).max() <= TOL
    tokens, _ = decoding.greedy_decode(model, params, src, valid, max_len=24, bos_id=0, eos_id=-1)
    np.testing.assert_array_equal(np.asarray(tokens[0]), sequence)


@pytest.mark.slow
def test_a_converted_t5_translates_greedy_and_beam_from_the_command_line_and_finetunes_on_tsv_pairs(tmp_path):
    import subprocess
    import sys

    from transformer import config as config_lib
    from transformer.training import loop

    texts = [open(json_module_source()).read(), "héllo wörld 你好 naïve café"] * 3
    t5_spiece(texts, tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    torch.manual_seed(0)
    theirs = perturbed(t5("T5ForConditionalGeneration", vocab_size=len(tok), num_decoder_layers=2), seed=2, scale=0.5)
    theirs.save_pretrained(tmp_path / "hf")  # beside spiece.model alone: the sentencepiece path
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "transformer.convert", f"--hf_dir={tmp_path / 'hf'}",
                          f"--workdir={run}"], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert "configs/encdec.py:t5-small" in out
    text = "def scan_once(string, idx):"
    with torch.no_grad():  # T5's conventions: </s> ends the input (the tokenizer adds it), decoding starts at <pad>
        expected = theirs.generate(**tok(text, return_tensors="pt"), max_new_tokens=8, do_sample=False)
    expected_text = tok.decode(expected[0], skip_special_tokens=True).strip()
    assert len(expected_text) > 5
    for beam in (1, 3):
        printed = subprocess.run([sys.executable, "-m", "transformer.generate", f"--workdir={run}", f"--input={text}",
                                  f"--beam_size={beam}", "--length_penalty=0"], capture_output=True, text=True,
                                 check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}).stdout.strip()
        assert printed and (beam > 1 or printed.startswith(expected_text)), (printed, expected_text)

    pairs = [f"def f{i}(x): return x + {i}\tadd {i}\n" for i in range(40)]
    (tmp_path / "train.tsv").write_text("".join(pairs))
    (tmp_path / "eval.tsv").write_text("".join(pairs[:20]))
    command = next(line for line in out.splitlines() if line.startswith("fine-tune:"))
    overrides = [flag[len("--config."):] for flag in command.split() if flag.startswith("--config.")]
    config = config_lib.load(os.path.join(REPO, "configs/encdec.py:t5-small"), overrides + [
        f"data.train_path={tmp_path / 'train.tsv'}", f"data.eval_path={tmp_path / 'eval.tsv'}", "data.batch_size=8",
        "data.source_len=24", "data.target_len=8", "data.eval_batches=1", "train.steps=2", "train.eval_every=2",
        "train.checkpoint_every=2"])
    assert config.data.source_eos
    last = loop.train(config, str(tmp_path / "finetune"))
    assert np.isfinite(last["eval/loss"])


BIN_INDEX_RSS = """
import sys
import torch
from transformer.interop import hf
peak = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])  # KiB
before = peak()
index = hf.checkpoint_index(sys.argv[1])
print(index["w"], index["b"], (peak() - before) // 1024)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="peak memory from /proc")
@pytest.mark.parametrize("form", ["zip", "legacy"])
def test_the_index_of_a_bin_checkpoint_reads_no_tensor_data(tmp_path, form):
    """checkpoint_index maps a (zip-format) pytorch_model.bin instead of reading its 256 MiB a first time."""
    torch.save({"w": torch.ones(2**26), "b": torch.zeros(3, dtype=torch.bfloat16)}, tmp_path / "pytorch_model.bin",
               _use_new_zipfile_serialization=form == "zip")
    out = subprocess.run([sys.executable, "-c", BIN_INDEX_RSS, str(tmp_path)], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[:2] == ["float32", "bfloat16"]
    assert (int(out[2]) < 64) == (form == "zip"), out  # MiB the index added to the process's peak
