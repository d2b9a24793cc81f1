"""Hugging Face interop: parity with transformers (PyTorch, CPU, eager attention) on small random
models saved to temp dirs, the export round trip, and tokenizer parity."""

import copy
import os
import subprocess
import sys
import json

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest
import torch
import transformers

from conftest import REPO
from transformer import models
from transformer.interop import hf
from transformer.interop.hf_families import Unsupported

TOL = 1e-4
B, L = 3, 12
LENGTHS = [12, 7, 3]  # a padded batch: rows end at these lengths


def perturbed(model: torch.nn.Module, seed: int = 0, scale: float = 0.05) -> torch.nn.Module:
    """`model` in eval mode with noise on every weight, so that zero biases and unit norms are tested too."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model.eval()


def token_batch(vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    valid = np.arange(L)[None, :] < np.asarray(LENGTHS)[:, None]  # [B, L]
    return np.where(valid, rng.integers(3, vocab, (B, L)), 0).astype(np.int32), valid


def gpt2(head_class):
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=101, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return getattr(transformers, head_class)(config)


def bert(head_class, **extra):
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                     intermediate_size=64, vocab_size=99, max_position_embeddings=32,
                                     type_vocab_size=2, num_labels=5, **extra)
    return getattr(transformers, head_class)(config)


def vit(head_class):
    config = transformers.ViTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                    image_size=16, patch_size=4, num_channels=3, num_labels=7)
    return getattr(transformers, head_class)(config)


def bart():
    config = transformers.BartConfig(encoder_layers=2, decoder_layers=2, d_model=32, encoder_attention_heads=4,
                                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                     vocab_size=97, max_position_embeddings=32)
    return transformers.BartForConditionalGeneration(config)


def t5(cls: str, **extra):
    """A small T5 (v1.0 unless feed_forward_proj='gated-gelu' and untied: v1.1), buckets reaching past L."""
    sizes = dict(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
                 relative_attention_num_buckets=8, relative_attention_max_distance=20, decoder_start_token_id=0,
                 pad_token_id=0, eos_token_id=1)
    return getattr(transformers, cls)(transformers.T5Config(**(sizes | extra)))


def decoder(cls: str, **extra):
    """A small Llama / Mistral / Qwen2 (grouped kv heads: 4 query heads share 2)."""
    kind = cls.replace("ForCausalLM", "").replace("Model", "")
    sizes = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, vocab_size=101, max_position_embeddings=64)
    config = getattr(transformers, f"{kind}Config")(**(sizes | extra))
    return getattr(transformers, cls)(config)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500.0}


def run_both(theirs: torch.nn.Module, model, params, family: str, head_class: str):
    """(ours, theirs, valid): the compared output of each on the same padded batch, and where it is valid."""
    if family == "vit":
        images = np.random.default_rng(0).normal(size=(B, 16, 16, 3)).astype(np.float32)
        with torch.no_grad():
            out = theirs(pixel_values=torch.tensor(images.transpose(0, 3, 1, 2)))
        ours = model.apply({"params": params}, images)
        if head_class == "ViTModel":
            return [(ours["hidden"], out.last_hidden_state), (ours["pooled"], out.pooler_output)], None
        return [(ours, out.logits)], None
    tokens, valid = token_batch(model.vocab_size)
    mask = torch.tensor(valid.astype(np.int64))
    with torch.no_grad():
        if family == "encdec" and head_class == "T5EncoderModel":
            out = theirs(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=mask)
            return [(model.apply({"params": params}, tokens, tokens, valid), out.last_hidden_state)], valid
        if family == "encdec":
            tgt, tgt_valid = token_batch(model.vocab_size, seed=1)
            out = theirs(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=mask,
                         decoder_input_ids=torch.tensor(tgt, dtype=torch.long),
                         decoder_attention_mask=torch.tensor(tgt_valid.astype(np.int64)))
            theirs_out = out.last_hidden_state if head_class == "BartModel" else out.logits
            return [(model.apply({"params": params}, tokens, tgt, valid, tgt_valid), theirs_out)], tgt_valid
        out = theirs(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=mask)
    if family == "gpt":
        ours = model.apply({"params": params}, tokens, valid)
        return [(ours, out.logits if head_class.endswith(("LMHeadModel", "ForCausalLM")) else out.last_hidden_state)], valid
    types = np.zeros_like(tokens)
    ours = model.apply({"params": params}, tokens, types, valid)
    if head_class == "BertModel":
        return [(ours["hidden"], out.last_hidden_state), (ours["pooled"], out.pooler_output)], None
    if head_class == "BertForPreTraining":
        return [(ours["mlm_logits"], out.prediction_logits), (ours["nsp_logits"], out.seq_relationship_logits)], None
    return [(ours.get("logits", ours.get("mlm_logits")), out.logits)], None


CASES = [
    ("gpt", "GPT2LMHeadModel", lambda: gpt2("GPT2LMHeadModel")),
    ("gpt", "GPT2Model", lambda: gpt2("GPT2Model")),
    ("bert", "BertModel", lambda: bert("BertModel")),
    ("bert", "BertForMaskedLM", lambda: bert("BertForMaskedLM")),
    ("bert", "BertForPreTraining", lambda: bert("BertForPreTraining")),
    ("bert", "BertForSequenceClassification", lambda: bert("BertForSequenceClassification")),
    ("bert", "BertForTokenClassification", lambda: bert("BertForTokenClassification", hidden_act="gelu_new")),
    ("vit", "ViTModel", lambda: vit("ViTModel")),
    ("vit", "ViTForImageClassification", lambda: vit("ViTForImageClassification")),
    ("encdec", "BartForConditionalGeneration", bart),
    ("encdec", "BartModel", lambda: transformers.BartModel(bart().config)),
    ("encdec", "T5ForConditionalGeneration", lambda: t5("T5ForConditionalGeneration")),
    ("encdec", "T5ForConditionalGeneration", lambda: t5("T5ForConditionalGeneration", feed_forward_proj="gated-gelu",
                                                        tie_word_embeddings=False)),
    ("encdec", "T5EncoderModel", lambda: t5("T5EncoderModel", feed_forward_proj="gated-gelu")),
    ("gpt", "LlamaForCausalLM", lambda: decoder("LlamaForCausalLM")),
    ("gpt", "LlamaModel", lambda: decoder("LlamaModel", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                         "rope_theta": 1000.0})),
    ("gpt", "LlamaForCausalLM", lambda: decoder("LlamaForCausalLM", rope_parameters=LLAMA3_ROPE,
                                                tie_word_embeddings=True)),
    ("gpt", "MistralForCausalLM", lambda: decoder("MistralForCausalLM", sliding_window=4)),
    ("gpt", "Qwen2ForCausalLM", lambda: decoder("Qwen2ForCausalLM", tie_word_embeddings=True)),
]


def assert_close(pairs, valid):
    for ours, theirs in pairs:
        ours, theirs = np.asarray(ours), theirs.numpy()
        assert ours.shape == theirs.shape
        if valid is not None:  # padded positions of a causal model attend to nothing real
            ours, theirs = ours[valid], theirs[valid]
        assert np.abs(ours - theirs).max() <= TOL, np.abs(ours - theirs).max()


@pytest.mark.parametrize("family, head_class, make", CASES,
                         ids=[f"{c[1]}-{i}" if [d[1] for d in CASES].count(c[1]) > 1 else c[1] for i, c in enumerate(CASES)])
def test_imported_model_matches_transformers_and_exports_back(tmp_path, family, head_class, make):
    torch.manual_seed(0)
    theirs = perturbed(make())
    theirs.save_pretrained(tmp_path / "hf")
    model, params, config = hf.load_pretrained(str(tmp_path / "hf"))
    assert config.model.family == family
    pairs, valid = run_both(theirs, model, params, family, head_class)
    assert_close(pairs, valid)

    hf.save_pretrained(params, config, str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [head_class]
    back = getattr(transformers, head_class).from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    pairs, valid = run_both(back, model, params, family, head_class)
    assert_close(pairs, valid)


def test_unsupported_options_fail_in_one_line(tmp_path):
    model = bert("BertModel", position_embedding_type="relative_key")
    model.save_pretrained(tmp_path)
    with pytest.raises(Unsupported, match="position_embedding_type='relative_key' is not supported"):
        hf.load_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(Unsupported, match="model_type='gpt_neox' is not supported"):
        hf.load_pretrained(str(tmp_path))


@pytest.mark.parametrize("cls, change, match", [
    ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope type 'yarn' is not supported"),
    ("LlamaForCausalLM", {"attention_bias": True}, "attention_bias=True is not supported"),
    ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ("Qwen2ForCausalLM", {"use_sliding_window": True}, "use_sliding_window=True is not supported"),
])
def test_decoder_options_the_gpt_family_cannot_express_fail_in_one_line(tmp_path, cls, change, match):
    decoder(cls).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(Unsupported, match=match):
        hf.load_pretrained(str(tmp_path))


@pytest.mark.parametrize("overrides, match", [
    (dict(positions="rotary", activation="swiglu", norm="layernorm"), "config.model.norm='layernorm' has no equivalent in transformers' Llama"),
    (dict(positions="rotary", norm="rmsnorm", activation="gelu", use_bias=False),
     "config.model.activation='gelu' has no equivalent in transformers' Llama"),
    (dict(positions="rotary", norm="rmsnorm", activation="swiglu", use_bias=False, qkv_bias=True, window=8),
     "config.model.window=8 has no equivalent in transformers' Qwen2"),
])
def test_a_gpt_that_no_transformers_class_expresses_fails_to_export_naming_the_key(tmp_path, overrides, match):
    config = ml_collections.ConfigDict(models.family("gpt").model_config("tiny") | overrides)
    params = nn.unbox(models.build(config).init(jax.random.key(0), np.zeros((1, 4), np.int32))["params"])
    with pytest.raises(Unsupported, match=match):
        hf.save_pretrained(params, config, str(tmp_path))


def test_a_checkpoint_is_placed_on_the_mesh_as_it_is_read(tmp_path):
    from jax.sharding import Mesh
    from transformer import sharding

    theirs = perturbed(decoder("LlamaForCausalLM", vocab_size=128))  # every size divides over the mesh
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
    rules = sharding.rules_of(ml_collections.ConfigDict(dict(data=1, fsdp=4, context=1, tensor=2,
                                                             rules=[[n, a] for n, a in sharding.DEFAULT_RULES])))
    _, placed, _ = hf.load_pretrained(str(tmp_path / "hf"), mesh=mesh, rules=rules)
    _, plain, _ = hf.load_pretrained(str(tmp_path / "hf"))
    up = placed["block_0"]["mlp"]["up"]["kernel"]  # [D, F]: embed over fsdp, mlp over tensor
    assert up.sharding.mesh.shape == {"fsdp": 4, "tensor": 2} and len(up.sharding.device_set) == 8
    assert up.addressable_shards[0].data.shape == (32 // 4, 64 // 2)
    jax.tree.map(np.testing.assert_array_equal, placed, plain)


def varied_strings(count: int = 300) -> list[str]:
    """Code lines, prose with accents / CJK / emoji / RTL, odd whitespace, and random mixtures."""
    code = [line for line in open(json_module_source()).read().splitlines() if line.strip()][:120]
    crafted = ["héllo wörld", "naïve café façade", "你好，世界", "こんにちは 世界", "안녕하세요", "مرحبا بالعالم",
               "emoji 🙂🚀👩‍💻 end", "tabs\tand\n\nnewlines  and   spaces ", "  leading", "trailing  ",
               "[CLS] a [SEP] b [MASK] [PAD]", "<|endoftext|>text<|endoftext|>", "x=1;y=2 # 注释",
               "ΑΒΓ αβγ ÅÄÖ", "don't won't can't", "UPPER lower MiXeD", "1,234.56 $%^&*()", "\u00a0nbsp\u2003em",
               "def f(*args, **kwargs) -> None: ...", "e\u0301 (combining)"]
    rng = np.random.default_rng(0)
    pool = list("abcxyzABC 019_.,;:()[]{}\t\n'\"#@!?-+=/\\é你🙂ü") + [" the ", " def ", "ing", "  "]
    mixed = ["".join(rng.choice(pool, rng.integers(1, 40))) for _ in range(count - len(code) - len(crafted))]
    return code + crafted + mixed


def json_module_source() -> str:
    return json.__file__.replace("__init__.py", "decoder.py")


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def llama3_style(texts: list[str]):
    """A tokenizer.json built as Llama 3's is (its split pattern, byte-level BPE, <|begin_of_text|> added by
    the post-processor), trained here on `texts`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=700, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[(specials[0], tok.token_to_id(specials[0]))])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1])


def t5_spiece(texts: list[str], directory) -> None:
    """A directory holding only a T5-style spiece.model (unigram; <pad> 0, </s> 1, <unk> 2) trained on `texts`."""
    import sentencepiece

    directory.mkdir()
    (directory / "train.txt").write_text("\n".join(texts))
    sentencepiece.SentencePieceTrainer.train(
        input=str(directory / "train.txt"), model_prefix=str(directory / "spiece"), vocab_size=400,
        model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0,
        minloglevel=2)
    for extra in ("train.txt", "spiece.vocab"):
        (directory / extra).unlink()
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "T5Tokenizer", "extra_ids": 10}))


def tokenizer_dirs(tmp_path):
    """(name, directory, transformers tokenizer) for each way a model directory carries its tokenizer."""
    from transformer.data.text import tokenizers

    texts = [open(json_module_source()).read(), "héllo wörld 你好 🙂 naïve café"] * 3
    bpe = tokenizers.train_bpe(texts, 600).tokenizer
    eot = "<|endoftext|>"
    bpe.add_special_tokens([eot])
    transformers.GPT2TokenizerFast(tokenizer_object=bpe, bos_token=eot, eos_token=eot, unk_token=eot) \
        .save_pretrained(tmp_path / "tokenizer_json")
    (tmp_path / "bpe_files").mkdir()
    bpe.model.save(str(tmp_path / "bpe_files"))
    vocab_json = tmp_path / "bpe_files" / "vocab.json"
    vocab_json.write_text(json.dumps({**json.loads(vocab_json.read_text()), eot: bpe.token_to_id(eot)}))
    (tmp_path / "bpe_files" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    llama3_style(texts).save_pretrained(tmp_path / "llama3_tokenizer_json")
    t5_spiece(texts, tmp_path / "t5_spiece")
    transformers.AutoTokenizer.from_pretrained(tmp_path / "t5_spiece").save_pretrained(tmp_path / "t5_tokenizer_json")
    vocab = tokenizers.train_wordpiece([t.lower() for t in texts] + texts, 500).tokenizer.get_vocab()
    for cased in (False, True):
        d = tmp_path / f"vocab_txt_{'cased' if cased else 'uncased'}"
        d.mkdir()
        (d / "vocab.txt").write_text("\n".join(sorted(vocab, key=vocab.get)))
        (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer",
                                                             "do_lower_case": not cased}))
    return [(d.name, d, transformers.AutoTokenizer.from_pretrained(d)) for d in sorted(tmp_path.iterdir())]


def test_tokenizers_encode_exactly_as_transformers_does(tmp_path):
    from transformer.data.text import tokenizers

    strings = varied_strings()
    assert len(strings) == 300
    dirs = tokenizer_dirs(tmp_path)
    assert {"llama3_tokenizer_json", "t5_spiece", "t5_tokenizer_json"} <= {name for name, _, _ in dirs}
    for name, directory, theirs in dirs:
        ours = tokenizers.hf_tokenizer(str(directory))
        for text in strings:
            expected = theirs(text, add_special_tokens=False)["input_ids"]
            assert ours.encode(text).tolist() == expected, (name, text)
        ours.save(str(tmp_path / "run" / name))  # a run directory keeps it
        again = tokenizers.load_tokenizer(str(tmp_path / "run" / name))
        assert [again.encode(t).tolist() for t in strings[:50]] == [ours.encode(t).tolist() for t in strings[:50]]
        assert again.special_id("[UNK]") == theirs.unk_token_id
        if name.startswith("t5"):  # T5's sentinels follow the pieces, <extra_id_0> last
            assert ours.vocab_size == len(theirs) and again.special_id("[EOS]") == theirs.eos_token_id == 1
            assert ours.special_id("<extra_id_0>") == theirs.convert_tokens_to_ids("<extra_id_0>") == len(theirs) - 1
        if name.startswith("llama3"):  # transformers adds <|begin_of_text|> (its post-processor); the tasks here do
            assert theirs("héllo")["input_ids"] == [ours.special_id("[BOS]"), *ours.encode("héllo").tolist()]


def hf_dir_with_tokenizer(tmp_path, make_model) -> tuple:
    """A transformers model directory holding a model and the byte-level BPE tokenizer of `tokenizer_dirs`."""
    (tmp_path / "tok").mkdir()
    name, directory, theirs_tok = next(d for d in tokenizer_dirs(tmp_path / "tok") if d[0] == "tokenizer_json")
    torch.manual_seed(0)
    theirs = perturbed(make_model(len(theirs_tok)))
    theirs.save_pretrained(tmp_path / "hf")
    theirs_tok.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", theirs, theirs_tok


def test_converted_gpt2_run_generates_and_finetunes_unchanged(tmp_path):
    import subprocess
    import sys
    import sysconfig

    from transformer import config as config_lib, decoding, rundir
    from transformer.training import loop

    make = lambda vocab: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=vocab, n_positions=64, bos_token_id=0, eos_token_id=0))
    hf_dir, theirs, theirs_tok = hf_dir_with_tokenizer(tmp_path, make)
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "transformer.convert", f"--hf_dir={hf_dir}", f"--workdir={run}"],
                         capture_output=True, text=True, check=True).stdout
    converted = rundir.open(str(run))
    model, params, tokenizer = converted.model(), converted.restore_params(), converted.tokenizer()
    text = "def decode(self, s):\n    return  s  # héllo"
    ids = tokenizer.encode(text)
    assert ids.tolist() == theirs_tok(text)["input_ids"]
    with torch.no_grad():
        expected = theirs(torch.tensor(ids[None], dtype=torch.long)).logits.numpy()
    assert np.abs(np.asarray(model.apply({"params": params}, ids[None])) - expected).max() <= TOL
    assert decoding.complete(model, params, tokenizer, "def ", 5)[0]

    command = next(line for line in out.splitlines() if line.startswith("fine-tune:"))
    overrides = [flag[len("--config."):] for flag in command.split() if flag.startswith("--config.")]
    assert {"optim.lr=5e-05", "optim.warmup_steps=100"} <= set(overrides)  # not gpt2-small's 6e-4 from scratch
    stdlib = sysconfig.get_paths()["stdlib"]
    config = config_lib.load("configs/gpt.py:gpt2-small", overrides + [
        f"data.source={stdlib}/json/*.py", "data.seq_len=32", "data.eval_fraction=0.3", "data.eval_batches=1",
        "train.steps=2", "train.eval_every=2", "train.sample_tokens=0"])
    finetune = loop.setup(config, str(tmp_path / "finetune"))
    for ours, converted in zip(jax.tree.leaves(finetune.state.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(converted))
    finetune.ckpt.close()
    finetune.writer.close()
    assert np.isfinite(loop.train(config, str(tmp_path / "finetune"))["eval/loss"])
    with pytest.raises(ValueError, match="holds weights only .* --config.init_from="):
        loop.setup(config, str(run))  # training on the converted directory itself


def test_converted_bart_run_translates(tmp_path):
    from transformer import convert, decoding, rundir

    make = lambda vocab: transformers.BartForConditionalGeneration(transformers.BartConfig(
        encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=vocab, max_position_embeddings=32))
    hf_dir, theirs, _ = hf_dir_with_tokenizer(tmp_path, make)
    convert.convert(str(hf_dir), str(tmp_path / "run"))
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
    from transformer import convert

    theirs = perturbed(bert("BertForSequenceClassification"))
    theirs.save_pretrained(tmp_path / "hf")
    out = convert.convert(str(tmp_path / "hf"), str(tmp_path / "run"))
    assert out["tokenizer"] is None and models.task_of(out["config"].model) == "sequence_classification"
    with pytest.raises(ValueError, match="already holds a run"):
        convert.convert(str(tmp_path / "hf"), str(tmp_path / "run"))


def test_bin_and_sharded_checkpoints_load_and_a_scanned_model_exports(tmp_path):
    from transformer.models import common

    theirs = perturbed(gpt2("GPT2LMHeadModel"))
    theirs.save_pretrained(tmp_path / "bin")  # transformers 5 writes safetensors only: make the older format
    (tmp_path / "bin" / "model.safetensors").unlink()
    torch.save(theirs.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "bin" / "pytorch_model.bin").exists()
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    (_, bin_params, config), (_, sharded_params, _) = (hf.load_pretrained(str(tmp_path / d)) for d in ("bin", "sharded"))
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
                                        ("MistralForCausalLM", dict(sliding_window=8))])
def test_a_converted_decoder_generates_transformers_greedy_tokens_with_its_kv_cache(tmp_path, cls, extra):
    from transformer import decoding
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
    new = decoding.generate(model, params, prompt, jax.random.key(0), max_new_tokens=32, temperature=0.0)
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
    from transformer import decoding
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
