"""Hugging Face interop: parity with transformers (PyTorch, CPU, eager attention) on small random
models saved to temp dirs, the export round trip, and tokenizer parity."""

import json

import numpy as np
import pytest
import torch
import transformers

from transformer.interop import hf
from transformer.interop.hf_families import Unsupported

TOL = 1e-4
B, L = 3, 12
LENGTHS = [12, 7, 3]  # a padded batch: rows end at these lengths


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """`model` in eval mode with noise on every weight, so that zero biases and unit norms are tested too."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
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
        if family == "encdec":
            tgt, tgt_valid = token_batch(model.vocab_size, seed=1)
            out = theirs(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=mask,
                         decoder_input_ids=torch.tensor(tgt, dtype=torch.long),
                         decoder_attention_mask=torch.tensor(tgt_valid.astype(np.int64)))
            return [(model.apply({"params": params}, tokens, tgt, valid, tgt_valid), out.logits)], tgt_valid
        out = theirs(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=mask)
    if family == "gpt":
        ours = model.apply({"params": params}, tokens, valid)
        return [(ours, out.last_hidden_state if head_class == "GPT2Model" else out.logits)], valid
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
]


def assert_close(pairs, valid):
    for ours, theirs in pairs:
        ours, theirs = np.asarray(ours), theirs.numpy()
        assert ours.shape == theirs.shape
        if valid is not None:  # padded positions of a causal model attend to nothing real
            ours, theirs = ours[valid], theirs[valid]
        assert np.abs(ours - theirs).max() <= TOL, np.abs(ours - theirs).max()


@pytest.mark.parametrize("family, head_class, make", CASES, ids=[c[1] for c in CASES])
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
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "t5"}))
    with pytest.raises(Unsupported, match="model_type='t5' is not supported"):
        hf.load_pretrained(str(tmp_path))
