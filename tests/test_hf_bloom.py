"""BLOOM in and out of Hugging Face: a tiny random BloomForCausalLM (eager attention) with a byte-level BPE
tokenizer.json laid out as BLOOM's, converted by `python -m transformer.convert --hf_dir`, gives transformers'
logits on a padded batch and its greedy continuation with the cache, and writes text with its tokenizer;
exported by `convert --workdir RUN --to_hf OUT`, it reloads in transformers with the same logits; the fused
query/key/value's per-head layout both ways; what BLOOM cannot express fails in one line."""

import json

import numpy as np
import pytest
import transformers
from conftest import REPO
from test_hf import TOL, perturbed, token_batch
from test_hf_runs import run_printed
from test_hf_tokenizers import json_module_source

from transformer import rundir
from transformer.inference import engine, sampling
from transformer.interop import hf, hf_bloom
from transformer.interop.hf_families import Unsupported

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]  # BLOOM's ids 0..3
TEXT = "def decode(self, s):\n    return  s  # héllo wörld"


def bloom_tokenizer(directory) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer.json with BLOOM's pipeline (its Split regex, then ByteLevel without GPT-2's
    regex; BLOOM's four specials first), saved in `directory` (transformers v5 has no BLOOM tokenizer class:
    PreTrainedTokenizerFast over the tokenizer.json, as AutoTokenizer loads BLOOM's)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(" ?[^(\\s|[.,!?…。，、।۔،])]+"), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    texts = [open(json_module_source()).read(), "héllo wörld 你好 🙂 naïve café"] * 3
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(directory)
    return tokenizer


def tiny_bloom(vocab: int, **extra) -> transformers.BloomForCausalLM:
    """Two layers of six heads (BLOOM's slopes past a power of two), weights perturbed away from their init."""
    config = transformers.BloomConfig(n_layer=2, hidden_size=48, n_head=6, vocab_size=vocab, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=3, attn_implementation="eager", **extra)
    torch.manual_seed(0)
    return perturbed(transformers.BloomForCausalLM(config), seed=1, scale=0.6)  # large: a varied greedy sequence


def logits_of(model, tokens, valid=None) -> np.ndarray:
    with torch.no_grad():
        mask = None if valid is None else torch.tensor(valid.astype(np.int64))
        return model(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=mask).logits.numpy()


@pytest.mark.slow
def test_a_converted_bloom_matches_transformers_decodes_greedily_with_its_cache_and_exports_back(tmp_path):
    theirs_tok = bloom_tokenizer(tmp_path / "hf")
    theirs = tiny_bloom(len(theirs_tok))
    theirs.save_pretrained(tmp_path / "hf")
    printed = run_printed(f"convert: python -m transformer.convert --hf_dir={tmp_path / 'hf'} --workdir=run "
                          f"--configs={REPO}/configs", cwd=tmp_path).splitlines()
    generate = next(line for line in printed if line.startswith("generate:"))
    assert run_printed(generate, "--max_new_tokens=4", cwd=tmp_path).startswith("TEXT")  # with its tokenizer
    run = rundir.open(str(tmp_path / "run"))
    model, params, tokenizer = run.model(), run.restore_params(), run.tokenizer()
    assert (run.config.model.positions, run.config.model.embed_norm) == ("alibi", True)

    ids = tokenizer.encode(TEXT)
    assert ids.tolist() == theirs_tok(TEXT)["input_ids"]
    assert tokenizer.decode(ids) == TEXT
    tokens, valid = token_batch(len(theirs_tok))
    ours = np.asarray(model.apply({"params": params}, tokens, valid))
    assert np.abs(ours - logits_of(theirs, tokens, valid))[valid].max() <= TOL

    prompt = ids[None, :6]
    with torch.no_grad():
        out = theirs.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=3)
    sequence = out[0, 6:].numpy()
    assert len(set(sequence.tolist())) >= 4  # not one repeated token (a tied head likes to repeat)
    new = np.array(engine.new_tokens(model, params, np.asarray(prompt).tolist(),
        sampling.Sampling(max_new_tokens=24)))
    np.testing.assert_array_equal(np.asarray(new[0]), sequence)
    text = engine.complete(model, params, tokenizer, TEXT[:12], sampling.Sampling(max_new_tokens=8))[0]
    start = tokenizer.encode(TEXT[:12]).tolist()
    assert text == tokenizer.decode(engine.new_tokens(model, params, [start], sampling.Sampling(max_new_tokens=8))[0])

    run_printed("export: python -m transformer.convert --workdir=run --to_hf=out", cwd=tmp_path)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["BloomForCausalLM"]
    back = transformers.BloomForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    back_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert back_tok(TEXT)["input_ids"] == ids.tolist()
    assert np.abs(logits_of(back, tokens, valid) - ours)[valid].max() <= TOL


@pytest.mark.parametrize("head_class", ["BloomForCausalLM", "BloomModel"])
def test_bloom_loads_and_saves_in_process_with_an_untied_head(tmp_path, head_class):
    theirs = tiny_bloom(101, tie_word_embeddings=False)
    if head_class == "BloomModel":
        theirs = theirs.transformer
    theirs.save_pretrained(tmp_path / "hf")
    model, params, config = hf.load_pretrained(str(tmp_path / "hf"))
    tokens, valid = token_batch(101)
    with torch.no_grad():
        out = theirs(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(valid.astype(int)))
    expected = out.logits if head_class == "BloomForCausalLM" else out.last_hidden_state
    ours = np.asarray(model.apply({"params": params}, tokens, valid))
    assert np.abs(ours - expected.numpy())[valid].max() <= TOL
    hf.save_pretrained(params, config, str(tmp_path / "out"))
    back = getattr(transformers, head_class).from_pretrained(tmp_path / "out").eval()
    for a, b in zip(theirs.state_dict().items(), back.state_dict().items()):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]


def test_the_fused_query_key_value_is_laid_out_per_head():
    heads, width, dh = 3, 12, 4
    rules = hf_bloom._fused_qkv(heads, width)
    weight = np.arange(3 * heads * dh * width, dtype=np.float32).reshape(-1, width)  # [H * 3 * Dh, D]
    q, k, v = rules[0].to_ours(weight)
    assert q.shape == (width, heads, dh)
    np.testing.assert_array_equal(k[:, 1, :], weight[(1 * 3 + 1) * dh:(1 * 3 + 2) * dh].T)  # head 1's key rows
    np.testing.assert_array_equal(rules[0].to_theirs(q, k, v), weight)
    bias = np.arange(3 * heads * dh, dtype=np.float32)
    np.testing.assert_array_equal(rules[1].to_theirs(*rules[1].to_ours(bias)), bias)


@pytest.mark.parametrize("change, match", [
    (dict(positions="learned"), "GPT-2"),  # exports as GPT-2, whose require refuses the embedding norm
    (dict(mlp_dim=100), "config.model.mlp_dim=100 has no equivalent in transformers' BLOOM"),
    (dict(embed_norm=False), "config.model.embed_norm=False has no equivalent in transformers' BLOOM"),
    (dict(num_kv_heads=2), "config.model.num_kv_heads=2 has no equivalent in transformers' BLOOM"),
])
def test_what_bloom_cannot_express_fails_to_export_naming_the_key(change, match):
    from transformer.models import gpt
    m = {**gpt.default_model_config("bloom-560m"), **change}
    with pytest.raises(Unsupported, match=match):
        hf.exporter(m).to_theirs(m)
    with pytest.raises(Unsupported, match="apply_residual_connection_post_layernorm"):
        hf_bloom.BLOOM.to_ours({"apply_residual_connection_post_layernorm": True}, set())
