"""LoRA to and from Hugging Face PEFT: a peft adapter on a tiny random GPT-2 and Llama converted here gives peft's
logits, an adapter trained here and exported loads in peft on the exported base with the run's logits, and the
merged and unmerged forms agree."""

import json

import jax
import numpy as np
import pytest
from conftest import REPO
from test_hf import decoder, gpt2, perturbed

from transformer import rundir
from transformer.interop import hf_export, hf_import, hf_peft
from transformer.interop.hf_families import Unsupported
from transformer.layers import lora
from transformer.training import loop

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.torch

TOL = 1e-4
GPT2_TARGETS = dict(target_modules=["c_attn", "attn.c_proj", "mlp.c_fc"], fan_in_fan_out=True,
                    rank_pattern={"mlp.c_fc": 4}, alpha_pattern={"attn.c_proj": 2.0})
LLAMA_TARGETS = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
                     rank_pattern={"v_proj": 4}, alpha_pattern={"o_proj": 8.0})
QWEN_TARGETS = dict(target_modules=["q_proj", "v_proj", "up_proj"], use_rslora=True)  # scaled by alpha / sqrt(r)


def tokens(vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(3, vocab, (2, 10)).astype(np.int32)


def logits_of(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def ours(workdir) -> tuple:
    run = rundir.open(str(workdir))
    return run, run.model(), run.restore_params()


def random_adapter(base, targets: dict, seed: int = 1):
    """`base` with a peft LoRA adapter (rank 2, alpha 4) of random, nonzero A and B."""
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4.0, init_lora_weights=False, **targets))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    return model.eval()


@pytest.mark.parametrize("make, targets, rank", [(lambda: gpt2("GPT2LMHeadModel"), GPT2_TARGETS, 4),
                                                 (lambda: decoder("LlamaForCausalLM"), LLAMA_TARGETS, 4),
                                                 (lambda: decoder("Qwen2ForCausalLM"), QWEN_TARGETS, 2)],
                         ids=["gpt2", "llama", "qwen2"])
def test_a_peft_adapter_converted_gives_peft_logits_and_exports_back(tmp_path, make, targets, rank):
    base = perturbed(make())
    base.save_pretrained(tmp_path / "hf")
    theirs = random_adapter(base, targets)
    theirs.save_pretrained(tmp_path / "adapter")
    ids = tokens(base.config.vocab_size)
    expected = logits_of(theirs, ids)
    hf_import.convert(str(tmp_path / "hf"), str(tmp_path / "run"), configs=f"{REPO}/configs",
                      adapter=str(tmp_path / "adapter"))
    run, model, params = ours(tmp_path / "run")
    assert run.config.lora.rank == rank and lora.ADAPTERS in params
    merged = np.asarray(model.apply({"params": params}, ids))
    unmerged = np.asarray(lora.unmerged_apply(model.model, model.lora, {"params": params}, ids))
    assert np.abs(merged - expected).max() <= TOL
    assert np.abs(unmerged - expected).max() <= TOL
    with theirs.disable_adapter():
        assert np.abs(logits_of(theirs, ids) - expected).max() > 1e-2  # the adapter changes the outputs

    hf_export.export_run(str(tmp_path / "run"), str(tmp_path / "out"), adapter=str(tmp_path / "out-adapter"))
    auto = pytest.importorskip("transformers").AutoModelForCausalLM
    again = peft.PeftModel.from_pretrained(auto.from_pretrained(tmp_path / "out", attn_implementation="eager"),
                                           tmp_path / "out-adapter")
    assert np.abs(logits_of(again, ids) - expected).max() <= TOL
    assert np.abs(logits_of(again.merge_and_unload(), ids) - expected).max() <= TOL


@pytest.mark.slow
def test_an_adapter_trained_here_loads_in_peft_on_the_exported_base(tmp_path, small_gpt_config):
    transformers = pytest.importorskip("transformers")
    config = small_gpt_config("lora.rank=2", "lora.alpha=8", "lora.targets=attention,mlp", "lora.dropout=0.1",
                              "train.steps=3", "train.sample_tokens=0", "train.eval_every=100")
    loop.train(config, str(tmp_path / "run"))
    run, model, params = ours(tmp_path / "run")
    assert all(np.abs(b).max() > 0 for b in jax.tree.leaves(params[lora.ADAPTERS]))  # trained: B moved off zero
    ids = np.asarray([list(b"def f(x): return x")], np.int32)
    expected = np.asarray(model.apply({"params": params}, ids))

    hf_export.export_run(str(tmp_path / "run"), str(tmp_path / "base"), adapter=str(tmp_path / "adapter"))
    adapter_config = json.load(open(tmp_path / "adapter" / hf_peft.CONFIG_FILE))
    assert adapter_config["fan_in_fan_out"] and adapter_config["lora_dropout"] == 0.1
    assert adapter_config["rank_pattern"] == {f"transformer.h.{i}.attn.c_attn": 6 for i in range(2)}
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    unadapted = logits_of(base, ids)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert np.abs(logits_of(theirs, ids) - expected).max() <= TOL
    assert np.abs(unadapted - expected).max() > 1e-3  # the base went out unmerged

    hf_export.export_run(str(tmp_path / "run"), str(tmp_path / "merged"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    assert np.abs(logits_of(merged, ids) - logits_of(theirs.merge_and_unload(), ids)).max() <= TOL

    hf_import.convert(str(tmp_path / "base"), str(tmp_path / "back"), configs=f"{REPO}/configs",
                      adapter=str(tmp_path / "adapter"))
    back, back_model, back_params = ours(tmp_path / "back")
    assert (back.config.lora.rank, back.config.lora.alpha) == (2, 8.0)  # the fused c_attn split back into q, k, v
    np.testing.assert_allclose(back_model.apply({"params": back_params}, ids), expected, atol=TOL)


def test_what_peft_cannot_express_fails_in_one_line(tmp_path, small_gpt_config):
    from test_hf_export import weights_only_run
    weights_only_run(tmp_path / "plain", small_gpt_config())
    with pytest.raises(ValueError, match="no LoRA adapters"):
        hf_export.export_run(str(tmp_path / "plain"), str(tmp_path / "out"), adapter=str(tmp_path / "adapter"))
    base = perturbed(gpt2("GPT2LMHeadModel"))
    base.save_pretrained(tmp_path / "hf")
    random_adapter(base, dict(target_modules=["c_attn"], use_dora=True)).save_pretrained(tmp_path / "dora")
    with pytest.raises(Unsupported, match="use_dora=True"):
        hf_import.convert(str(tmp_path / "hf"), str(tmp_path / "run"), configs=f"{REPO}/configs",
                          adapter=str(tmp_path / "dora"))
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        hf_import.convert(str(tmp_path / "hf"), str(tmp_path / "run"), adapter=str(tmp_path / "nothing"))


def test_an_adapter_that_disagrees_with_its_config_fails_naming_the_file_and_tensor(tmp_path):
    """An adapter written by peft (rank 2 on c_attn), then edited: its config's r, its weights' ranks, its
    target_modules, its features or its JSON; each import fails in one line naming the file and the tensor."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from transformer.interop import hf
    base = perturbed(gpt2("GPT2LMHeadModel"))
    base.save_pretrained(tmp_path / "hf")
    random_adapter(base, dict(target_modules=["c_attn"], fan_in_fan_out=True)).save_pretrained(tmp_path / "good")
    _, params, config = hf.load_pretrained(str(tmp_path / "hf"), configs=f"{REPO}/configs")
    tensors = load_file(tmp_path / "good" / hf_peft.WEIGHTS_FILE)
    a_name = next(n for n in sorted(tensors) if "lora_A" in n)
    b_name = a_name.replace("lora_A", "lora_B")

    def edited(name, settings=None, weights=None, text=None) -> str:
        path = shutil.copytree(tmp_path / "good", tmp_path / name)
        if settings or text:
            adapter_config = json.load(open(path / hf_peft.CONFIG_FILE))
            (path / hf_peft.CONFIG_FILE).write_text(text or json.dumps({**adapter_config, **settings}))
        if weights:
            save_file({**tensors, **weights}, str(path / hf_peft.WEIGHTS_FILE))
        return str(path)

    def pad(x, axis, to):
        return np.ascontiguousarray(np.pad(x, [(0, to - n) if i == axis else (0, 0) for i, n in enumerate(x.shape)]))

    d = tensors[a_name].shape[1]
    for path, says in [
            (edited("r8", {"r": 8}), f"{a_name} is of shape \\[2, {d}\\], rank 2, but adapter_config.json .* r=8"),
            (edited("rank4", weights={n: pad(tensors[n], "lora_B" in n, 4) for n in tensors}),
             f"{a_name} is of shape \\[4, {d}\\], rank 4, .* r=2"),
            (edited("ab", weights={b_name: pad(tensors[b_name], 1, 4)}), f"{b_name} is of shape .*, rank 4, .* r=2"),
            (edited("targets", {"target_modules": ["c_proj"]}), f"{a_name} adapts .* target_modules \\['c_proj'\\]"),
            (edited("wide", weights={a_name: pad(tensors[a_name], 1, d + 1)}), f"lora_A.weight has {d + 1} in"),
            (edited("json", text='{"r": 2,'), "adapter_config.json is not JSON")]:
        with pytest.raises(ValueError, match=says) as raised:
            hf_peft.import_adapter(path, config, params)
        assert path in str(raised.value) and "\n" not in str(raised.value)
    assert hf_peft.import_adapter(str(tmp_path / "good"), config, params)[0].lora.rank == 2
