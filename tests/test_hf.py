"""Hugging Face interop: parity with transformers (PyTorch, CPU, eager attention) on small random
models saved to temp dirs, the export round trip, and tokenizer parity."""

import json

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest
import transformers

from transformer import models
from transformer.interop import hf
from transformer.interop.hf_families import Unsupported

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

TOL = 1e-4
B, L = 3, 12
LENGTHS = [12, 7, 3]  # a padded batch: rows end at these lengths


def perturbed(model: torch.nn.Module, seed: int = 0, scale: float = 0.05) -> torch.nn.Module:
    """`model` in eval mode with noise on every trained weight, so that zero biases and unit norms are tested too
    (not on a frozen table: Marian's sinusoids are computed on load, never read from the checkpoint)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
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


def ijepa(head_class):
    config = transformers.IJepaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                      image_size=16, patch_size=4, num_channels=3, num_labels=7, layer_norm_eps=1e-6)
    return getattr(transformers, head_class)(config)


def marian(**extra):
    """A small Marian (width 30: the sines' and cosines' halves are of odd size), with a final_logits_bias (a buffer,
    which `perturbed` leaves alone)."""
    sizes = dict(encoder_layers=2, decoder_layers=3, d_model=30, encoder_attention_heads=3, decoder_attention_heads=3,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=97, max_position_embeddings=32,
                 activation_function="relu", scale_embedding=True, pad_token_id=0, decoder_start_token_id=0)
    model = transformers.MarianMTModel(transformers.MarianConfig(**(sizes | extra)))
    model.final_logits_bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    return model


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
    """A small Llama / Mistral / Qwen2 / Qwen3 (grouped kv heads: 4 query heads share 2); Mixtral and Qwen3-MoE
    with 4 experts, 2 per token."""
    kind = cls.replace("ForCausalLM", "").replace("Model", "")
    sizes = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, vocab_size=101, max_position_embeddings=64)
    sizes |= {"Mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
              "Qwen3Moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=16)
              }.get(kind, {})
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
        if head_class.endswith("Model"):
            pooled = [(ours["pooled"], out.pooler_output)] if "pooled" in ours else []
            return [(ours["hidden"], out.last_hidden_state), *pooled], None
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
        theirs_out = out.logits if head_class.endswith(("LMHeadModel", "ForCausalLM")) else out.last_hidden_state
        return [(ours, theirs_out)], valid
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
    ("vit", "IJepaModel", lambda: ijepa("IJepaModel")),
    ("vit", "IJepaForImageClassification", lambda: ijepa("IJepaForImageClassification")),
    ("encdec", "MarianMTModel", marian),
    ("encdec", "MarianMTModel", lambda: marian(activation_function="gelu", scale_embedding=False)),
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
    ("gpt", "Qwen3ForCausalLM", lambda: decoder("Qwen3ForCausalLM", head_dim=16, tie_word_embeddings=True)),
    ("gpt", "Qwen3ForCausalLM", lambda: decoder("Qwen3ForCausalLM", head_dim=8, rms_norm_eps=1e-5)),
    ("gpt", "Qwen3Model", lambda: decoder("Qwen3Model", head_dim=16)),
    ("gpt", "MixtralForCausalLM", lambda: decoder("MixtralForCausalLM")),
    ("gpt", "MixtralForCausalLM", lambda: decoder("MixtralForCausalLM", sliding_window=4, tie_word_embeddings=True)),
    ("gpt", "MixtralModel", lambda: decoder("MixtralModel")),
    ("gpt", "Qwen3MoeForCausalLM", lambda: decoder("Qwen3MoeForCausalLM", norm_topk_prob=True)),
    ("gpt", "Qwen3MoeForCausalLM", lambda: decoder("Qwen3MoeForCausalLM", norm_topk_prob=False)),
    ("gpt", "Qwen3MoeForCausalLM", lambda: decoder("Qwen3MoeForCausalLM", use_sliding_window=True, sliding_window=4)),
    ("gpt", "Qwen3MoeModel", lambda: decoder("Qwen3MoeModel")),
    ("gpt", "Qwen3MoeForCausalLM", lambda: decoder("Qwen3MoeForCausalLM", num_hidden_layers=4, decoder_sparse_step=2)),
    ("gpt", "Qwen3MoeForCausalLM", lambda: decoder("Qwen3MoeForCausalLM", num_hidden_layers=5, decoder_sparse_step=2,
                                                   mlp_only_layers=[1], intermediate_size=40)),
    # layers 0 and 2 sparse, 1 dense: model.dense_layers='1' (moe_every and dense_first cannot say it)
    ("gpt", "Qwen3MoeForCausalLM", lambda: decoder("Qwen3MoeForCausalLM", num_hidden_layers=3, mlp_only_layers=[1],
                                                   intermediate_size=40)),
    ("gpt", "Qwen3MoeForCausalLM", lambda: decoder("Qwen3MoeForCausalLM", num_hidden_layers=4, decoder_sparse_step=2,
                                                   mlp_only_layers=[0, 3], intermediate_size=40)),
]


def assert_close(pairs, valid):
    for ours, theirs in pairs:
        ours, theirs = np.asarray(ours), theirs.numpy()
        assert ours.shape == theirs.shape
        if valid is not None:  # padded positions of a causal model attend to nothing real
            ours, theirs = ours[valid], theirs[valid]
        assert np.abs(ours - theirs).max() <= TOL, np.abs(ours - theirs).max()


@pytest.mark.parametrize("family, head_class, make", CASES,
                         ids=[f"{c[1]}-{i}" if [d[1] for d in CASES].count(c[1]) > 1 else c[1]
                              for i, c in enumerate(CASES)])
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
    ("Qwen3ForCausalLM", {"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ("Qwen3MoeForCausalLM", {"decoder_sparse_step": 3}, "decoder_sparse_step=3 and mlp_only_layers=.* make no layer"),
])
def test_decoder_options_the_gpt_family_cannot_express_fail_in_one_line(tmp_path, cls, change, match):
    decoder(cls).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(Unsupported, match=match):
        hf.load_pretrained(str(tmp_path))


LLAMA_FORM = dict(positions="rotary", norm="rmsnorm", activation="swiglu", use_bias=False)


@pytest.mark.parametrize("overrides, match", [
    (dict(positions="rotary", activation="swiglu", norm="layernorm"),
     "config.model.norm='layernorm' has no equivalent in transformers' Llama"),
    (dict(positions="rotary", norm="rmsnorm", activation="gelu", use_bias=False),
     "config.model.activation='gelu' has no equivalent in transformers' Llama"),
    (dict(positions="rotary", norm="rmsnorm", activation="swiglu", use_bias=False, qkv_bias=True, window=8),
     "config.model.window=8 has no equivalent in transformers' Qwen2"),
    (dict(positions="rotary", norm="rmsnorm", activation="swiglu", use_bias=False, qk_norm=True, qkv_bias=True),
     "config.model.qkv_bias=True has no equivalent in transformers' Qwen3"),
    (dict(positions="rotary", norm="rmsnorm", activation="swiglu", use_bias=False, logit_softcap=30.0),
     "config.model.logit_softcap=30.0 has no equivalent in transformers' Llama"),
    (dict(qk_norm=True), "config.model.qk_norm=True has no equivalent in transformers' GPT-2"),
    (dict(LLAMA_FORM, num_experts=4, normalize_topk=False),
     "config.model.normalize_topk=False has no equivalent in transformers' Mixtral"),
    (dict(LLAMA_FORM, num_experts=4, shared_expert_dim=16),
     "config.model.shared_expert_dim=16 has no equivalent in transformers' Mixtral"),
    (dict(LLAMA_FORM, num_experts=4, moe_every=2),
     "config.model.moe_every=2 has no equivalent in transformers' Mixtral"),
    (dict(LLAMA_FORM, num_experts=4, qk_norm=True, qkv_bias=True),
     "config.model.qkv_bias=True has no equivalent in transformers' Qwen3-MoE"),
])
def test_a_gpt_that_no_transformers_class_expresses_fails_to_export_naming_the_key(tmp_path, overrides, match):
    config = ml_collections.ConfigDict(models.family("gpt").model_config("tiny") | overrides)
    params = nn.unbox(models.build(config).init(jax.random.key(0), np.zeros((1, 4), np.int32))["params"])
    with pytest.raises(Unsupported, match=match):
        hf.save_pretrained(params, config, str(tmp_path))


def test_experts_split_over_shards_load_whole_and_a_missing_expert_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    theirs = perturbed(decoder("MixtralForCausalLM"))
    theirs.save_pretrained(tmp_path / "whole")
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")  # a layer's experts in several files
    (_, whole, _), (_, sharded, _) = (hf.load_pretrained(str(tmp_path / d)) for d in ("whole", "sharded"))
    jax.tree.map(np.testing.assert_array_equal, whole, sharded)
    np.testing.assert_array_equal(whole["block_1"]["mlp"]["down"][3],
                                  theirs.model.layers[1].mlp.experts.down_proj[3].detach().numpy().T)
    tensors = load_file(tmp_path / "whole" / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, tmp_path / "whole" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no layers.1.block_sparse_moe.experts.3.w2.weight \(needed for "
                                         r"block_1/mlp/down\)"):
        hf.load_pretrained(str(tmp_path / "whole"))


@pytest.mark.parametrize("cls, coef", [("MixtralForCausalLM", 0.02), ("Qwen3MoeForCausalLM", None)])
def test_the_router_loss_coefficient_comes_in_as_k_times_the_weight_and_goes_back_out(tmp_path, cls, coef):
    """transformers' load-balancing loss of one layer is k = 2 times ours; a run converted from its
    checkpoint weighs ours by k x router_aux_loss_coef (0.001 where config.json has none), fine-tunes with
    that weight, and exports the coefficient back."""
    from transformer.interop import hf_export, hf_import
    from transformer.layers import moe
    from transformer.models import common

    torch.manual_seed(0)
    theirs = perturbed(decoder(cls, num_hidden_layers=1, **({"router_aux_loss_coef": coef} if coef else {})))
    theirs.save_pretrained(tmp_path / "hf")
    if coef is None:
        config_json = json.loads((tmp_path / "hf" / "config.json").read_text())
        del config_json["router_aux_loss_coef"]
        (tmp_path / "hf" / "config.json").write_text(json.dumps(config_json))
    config = hf_import.convert(str(tmp_path / "hf"), str(tmp_path / "run"))["config"]
    weight = 2 * (coef or 0.001)
    assert config.train.load_balance_weight == pytest.approx(weight)
    assert f"--config.train.load_balance_weight={config.train.load_balance_weight}" in hf_import.finetune_command(
        config, str(tmp_path / "run"))
    tokens, _ = token_batch(101)
    with torch.no_grad():
        their_loss = theirs(input_ids=torch.tensor(tokens, dtype=torch.long), output_router_logits=True).aux_loss
    model, params, _ = hf.load_pretrained(str(tmp_path / "hf"))
    with common.sowing() as found:
        model.apply({"params": params}, tokens)
    np.testing.assert_allclose(float(their_loss), 2 * float(moe.collect(found)["load_balance"]), rtol=1e-5)
    hf_export.export_run(str(tmp_path / "run"), str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["router_aux_loss_coef"] == pytest.approx(
        coef or 0.001)


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
