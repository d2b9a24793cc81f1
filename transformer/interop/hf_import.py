"""A Hugging Face model directory into a run directory (`python -m transformer.convert --hf_dir DIR --workdir RUN`).

    out = hf_import.convert("path/to/gpt2", "runs/gpt2")          # {'config', 'tokenizer', 'params'}
    hf_import.import_commands(out["config"], "runs/gpt2", "configs", out["tokenizer"])   # what to run next

The run directory holds config.json (the family's config file, from `configs`, with the imported model), an
orbax checkpoint of the weights at step 0 in their stored dtype (no optimizer state), the tokenizer, a
classifier's label names (its id2label, as labels.json, unless they are transformers' LABEL_0, LABEL_1, ...)
and an image classifier's statistics and crop (its preprocessor_config.json, as config.data.mean, std and
crop_fraction). `hf_export` is the way back out.
"""

import os
import shlex

from transformer import config as config_lib
from transformer import models, rundir
from transformer.data.text import chat_templates as templates
from transformer.data.text import tokenizers
from transformer.interop import hf, hf_inputs, hf_peft


def convert(hf_dir: str, workdir: str, param_dtype: str = "", configs: str = "configs", adapter: str = "") -> dict:
    """Writes the run directory; returns {'config', 'tokenizer' (or None), 'params'}. The weights keep
    their stored dtype unless `param_dtype` is given (config.model.param_dtype records it); the config
    is the family's file under `configs` (config.model alone where that is no directory). `adapter`: a PEFT
    LoRA adapter directory put onto the model (config.lora, params["lora"]: `hf_peft`)."""
    if os.path.isdir(os.path.join(workdir, rundir.CHECKPOINTS)):
        raise ValueError(f"{workdir} already holds a run; choose a new --workdir")
    _, params, config = hf.load_pretrained(hf_dir, param_dtype=param_dtype or None, configs=configs)
    if adapter:
        config, params = hf_peft.import_adapter(adapter, config, params)
    hf_config = hf.read_config(hf_dir)
    tokenizer = _tokenizer(hf_dir, hf_config, config)
    if tokenizer is not None and "tokenizer_path" in config.get("data", {}):
        config.data.tokenizer_path = os.path.abspath(workdir)  # its own copy, read by evaluate and fine-tuning
    if "mean" in config.get("data", {}):
        config.data.update(hf_inputs.image_settings(hf_dir))  # the processor's statistics, which predict reads
    run = rundir.RunDir(workdir)
    run.write_config(config)
    if tokenizer is not None:
        tokenizer.save(workdir)
        chat = templates.from_hf_directory(tokenizer, hf_dir)
        if chat is not None:  # its chat_template, which chat, serve and the sft task read
            chat.save(workdir)
    names = label_names(hf_config, config)
    if names:
        rundir.save_labels(workdir, names)
    ckpt = run.checkpointer()
    ckpt.save_params(params)
    ckpt.wait()
    ckpt.close()
    return {"config": config, "tokenizer": tokenizer, "params": params}


def _tokenizer(hf_dir: str, hf_config: dict, config):
    """The directory's tokenizer (None without tokenizer files); an encoder-decoder's [BOS] is the
    token its decoder starts from."""
    try:
        tokenizer = tokenizers.hf_tokenizer(hf_dir)
    except FileNotFoundError:
        return None
    start = hf.architecture_of(hf_config)[0].decoder_start(hf_config)
    if start is not None:
        tokenizer.specials["[BOS]"] = tokenizer.token(start)
    tokenizers.check_fits(tokenizer.vocab_size, tokenizer.kind, config.model.vocab_size)
    return tokenizer


# A pretrained model's fine-tuning: transformers' Trainer default learning rate (the presets' are for
# training from scratch, 6e-4 and up, enough to wreck pretrained weights) and a short warmup.
FINETUNE_OPTIM = {"lr": 5e-5, "warmup_steps": 100}


# A converted classifier's labelled data, which its commands name (the embedded examples' labels are not its head's).
LABELLED = {"sequence_classification": {"train_path": "TRAIN.tsv", "eval_path": "EVAL.tsv"},
            "token_classification": {"train_path": "TRAIN.conll", "eval_path": "EVAL.conll"},
            "image_classification": {"source": "IMAGE_FOLDER"}}

FROM_THE_LABELS = ("model.num_labels", "model.num_classes")  # a fine-tuning run's data gives them

def task_of(config) -> str | None:
    """The converted model's task; None for a model without a head (hidden states: no task)."""
    try:
        return models.task_of(config.model)
    except ValueError:
        return None


def label_names(hf_config: dict, config) -> list[str] | None:
    """A converted classifier's label names by id (config.json's id2label), None for another model or for
    transformers' default names (LABEL_0, LABEL_1, ...: the run reports the ids)."""
    id2label = hf_config.get("id2label") or {}
    names = [name for _, name in sorted(id2label.items(), key=lambda item: int(item[0]))]
    if task_of(config) not in LABELLED or names == [f"LABEL_{i}" for i in range(len(names))]:
        return None
    return names


def finetune_command(config, workdir: str, configs: str = "configs") -> str:
    """The `transformer.train` command that starts from the converted run: its config file and every key of
    config.model (a headless model's head left to the file, a classifier's number of labels to its data: a
    new head where they are not the converted model's), config.data, config.train and config.lora (an imported
    adapter's) the run changed, a classifier's labelled data (LABELLED), and FINETUNE_OPTIM's settings."""
    spec = os.path.join(configs, hf.run_config_spec(config.model))
    preset, task = config_lib.load(spec), task_of(config)
    changed = {f"{section}.{k}": v for section in ("model", "data", "train", "lora")
               for k, v in config[section].items() if preset[section].get(k) != v
               and (section, k, task) != ("model", "head", None) and f"{section}.{k}" not in FROM_THE_LABELS}
    changed |= {f"data.{k}": v for k, v in LABELLED.get(task, {}).items()}
    changed |= {f"optim.{k}": v for k, v in FINETUNE_OPTIM.items() if preset.optim.get(k) != v}
    flags = [f"--config.{k}={v}" for k, v in {**changed, "init_from": workdir}.items()]
    return shlex.join(["python", "-m", "transformer.train", "--config", spec, *flags, "--workdir", "NEW_RUN_DIR"])


def import_commands(config, workdir: str, configs: str, tokenizer) -> list[str]:
    """What the converted run does next (generate, evaluate, fine-tune), as the commands that do it."""
    if tokenizer is None and "vocab_size" in config.model:
        return ["no tokenizer files found: generate, evaluate and fine-tune read text with the model's own; add "
                "them to --hf_dir (tokenizer.json, or vocab.json + merges.txt, vocab.txt, spiece.model) and "
                "convert again"]
    generation, task = models.family(config.model.family).generation, task_of(config)
    lines = [f"generate:  python -m transformer.generate --workdir {shlex.quote(workdir)} --{generation} TEXT"
             ] if generation and task else []
    if "data" not in config:
        return lines + [f"no config files in {configs}/: convert with --configs (the repository's configs/) for "
                        "a run that evaluates and fine-tunes"]
    labelled = LABELLED.get(task, {})
    if task is not None:
        lines.append("evaluate:  " + shlex.join(["python", "-m", "transformer.evaluate", "--workdir", workdir,
                                                 *(f"--config.data.{k}={v}" for k, v in labelled.items())]))
    lines.append(f"fine-tune: {finetune_command(config, workdir, configs)}")
    if labelled:
        spec = os.path.join(configs, hf.run_config_spec(config.model).partition(":")[0])
        lines.append(f"data:      {', '.join(labelled.values())}: your labelled data for its {task} head "
                     f"(formats: {spec})")
    return lines
