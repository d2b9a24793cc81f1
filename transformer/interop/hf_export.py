"""A run directory as a Hugging Face model directory (`python -m transformer.convert --workdir RUN --to_hf OUT`).

    hf_export.export_run("runs/bert-reviews", "out/bert-reviews")      # the latest checkpoint
    model = transformers.AutoModelForSequenceClassification.from_pretrained("out/bert-reviews")
    tokenizer = transformers.AutoTokenizer.from_pretrained("out/bert-reviews")

OUT is what `hf.save_pretrained` writes of the run's weights, config, tokenizer, label names (a
classifier's) and image statistics (an image classifier's): config.json and model.safetensors, the
tokenizer's files and an image processor's (`hf_inputs`). A model no transformers class expresses (a
family, a head, a config.model value) fails in one line naming it.
"""

import json
import os

import jax
import ml_collections
import tokenizers as hf_tokenizers

from transformer import rundir
from transformer.data.images import normalisation
from transformer.data.text import chat_templates as templates
from transformer.data.text import tokenizers
from transformer.interop import hf, hf_peft
from transformer.layers import lora


def export_run(workdir: str, path: str, step: int | None = None, param_dtype: str = "", adapter: str = "") -> dict:
    """Writes the run in `workdir` (checkpoint `step`, default the latest) as a transformers model directory
    `path`; returns {'class', 'step', 'params' (their count), 'files'}. `param_dtype` (default the run's)
    is the dtype of the weights written. A run with LoRA adapters is written merged, or with `adapter` its
    base unmerged and its adapters as the PEFT adapter directory `adapter` (`hf_peft`)."""
    if os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"{path} already holds a model; choose a new --to_hf")
    run = rundir.open(workdir)
    config = ml_collections.ConfigDict(run.config.to_dict())
    if param_dtype:
        config.model.param_dtype = param_dtype
    hf.exporter(config.model.to_dict())  # what transformers cannot express fails before the checkpoint is read
    tokenizer = run.tokenizer(framed=False) if os.path.isfile(os.path.join(workdir, tokenizers.CONFIG_FILE)) else None
    step = run.checkpoint_step(step)
    params = run.restore_params(step)
    if adapter:
        hf_peft.save_adapter(params, config, adapter, os.path.abspath(path))
        params = {k: v for k, v in params.items() if k != lora.ADAPTERS}
    params = lora.merged(params, lora.Lora.of(config.get("lora")).scale)  # adapters folded in
    hf.save_pretrained(params, config, path, tokenizer, run.labels,
                       normalisation.recorded_statistics(config.get("data"), workdir))
    if os.path.isfile(os.path.join(workdir, templates.FILE)):
        export_chat(templates.for_run(workdir), path)
    return {"class": hf.read_config(path)["architectures"][0], "step": step, "files": sorted(os.listdir(path)),
            "params": sum(x.size for x in jax.tree.leaves(params))}


def export_chat(chat: templates.ChatFormat, path: str) -> None:
    """A chat model's template in the exported tokenizer_config.json (apply_chat_template renders as the run
    does), its added markers as special tokens of tokenizer.json, and its end-of-turn ids as generate's
    eos_token_id (generation_config.json)."""
    fast = hf_tokenizers.Tokenizer.from_file(os.path.join(path, tokenizers.HF_FILE))
    for marker, i in sorted(chat.added.items(), key=lambda kv: kv[1]):
        if fast.get_vocab_size() != i:
            raise ValueError(f"the chat marker {marker} is id {i}, but the exported tokenizer has "
                             f"{fast.get_vocab_size()} ids before it")
        fast.add_special_tokens([marker])
    fast.save(os.path.join(path, tokenizers.HF_FILE))
    settings = json.load(open(os.path.join(path, tokenizers.CONFIG_FILE)))
    settings["chat_template"] = chat.source
    settings.update({k: v for k, v in (("bos_token", chat.bos_token), ("eos_token", chat.eos_token)) if v})
    with open(os.path.join(path, tokenizers.CONFIG_FILE), "w") as f:
        json.dump(settings, f, indent=2, ensure_ascii=False)
    generation = os.path.join(path, "generation_config.json")
    existing = json.load(open(generation)) if os.path.isfile(generation) else {}
    with open(generation, "w") as f:
        json.dump({**existing, "eos_token_id": list(chat.end_ids)}, f, indent=2)
