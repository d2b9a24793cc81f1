"""A run directory as a Hugging Face model directory (`python -m transformer.convert --workdir RUN --to_hf OUT`).

    hf_export.export_run("runs/bert-reviews", "out/bert-reviews")      # the latest checkpoint
    model = transformers.AutoModelForSequenceClassification.from_pretrained("out/bert-reviews")
    tokenizer = transformers.AutoTokenizer.from_pretrained("out/bert-reviews")

OUT holds config.json and model.safetensors (`hf.save_pretrained`), with the run's label names (a
classifier's) and its tokenizer's special-token ids (pad, bos, eos; an encoder-decoder's decoder start is
its [BOS]), and the tokenizer's files, which encode as the run's tokenizer does:

  tokenizer.json (bpe, wordpiece, gpt2, hf)  itself, for PreTrainedTokenizerFast, its special tokens named in
      tokenizer_config.json; a BERT's adds [CLS] text [SEP] (the tasks' framing) where it has no post-processor
  byte                                       a tokenizer.json of the 256 bytes (id = byte value): a byte-level
      BPE without merges, so that any text encodes to its UTF-8 bytes and decodes back
  spiece.model (T5's sentencepiece)          itself, for T5Tokenizer, with the run's extra_ids

A model no transformers class expresses (a family, a head, a config.model value) fails in one line naming it.
"""

import json
import os
import shutil

import jax
import ml_collections
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from transformer import rundir
from transformer.data.text import sentencepiece_tokenizer as spm
from transformer.data.text import tokenizers as ours
from transformer.interop import hf

# Our names of the special tokens -> the keys transformers' tokenizer_config.json names them by.
TOKEN_KEYS = {"[PAD]": "pad_token", "[UNK]": "unk_token", "[CLS]": "cls_token", "[SEP]": "sep_token",
              "[MASK]": "mask_token", "[BOS]": "bos_token", "[EOS]": "eos_token"}


def export_run(workdir: str, path: str, step: int | None = None, param_dtype: str = "") -> dict:
    """Writes the run in `workdir` (checkpoint `step`, default the latest) as a transformers model directory
    `path`; returns {'class', 'step', 'params' (their count), 'files'}. `param_dtype` (default the run's)
    is the dtype of the weights written."""
    if os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"{path} already holds a model; choose a new --to_hf")
    run = rundir.open(workdir)
    model_cfg = ml_collections.ConfigDict({**run.config.model.to_dict(),
                                           **({"param_dtype": param_dtype} if param_dtype else {})})
    arch = hf.exporter(model_cfg.to_dict())
    tokenizer = run.tokenizer() if os.path.isfile(os.path.join(workdir, ours.CONFIG_FILE)) else None
    settings = {**label_settings(run.labels), **(token_ids(tokenizer, arch) if tokenizer else {})}
    step = run.checkpoint_step(step)
    params = run.restore_params(step)
    hf.save_pretrained(params, ml_collections.ConfigDict({"model": model_cfg, "train": run.config.train}), path,
                       settings)
    if tokenizer is not None:
        save_tokenizer(tokenizer, path, arch.wraps, model_cfg.get("max_len"))
    return {"class": hf.read_config(path)["architectures"][0], "step": step, "files": sorted(os.listdir(path)),
            "params": sum(x.size for x in jax.tree.leaves(params))}


def label_settings(names: list[str] | None) -> dict:
    """config.json's id2label and label2id of a classifier's label names (nothing for other models)."""
    if names is None:
        return {}
    return {"id2label": dict(enumerate(names)), "label2id": {name: i for i, name in enumerate(names)}}


def token_ids(tokenizer, arch) -> dict:
    """config.json's special-token ids (None where the tokenizer has no such token)."""
    start = {arch.start_token: tokenizer.special_id("[BOS]")} if arch.start_token else {
        "bos_token_id": tokenizer.special_id("[BOS]")}
    return {"pad_token_id": tokenizer.special_id("[PAD]"), "eos_token_id": tokenizer.special_id("[EOS]"), **start}


def save_tokenizer(tokenizer, path: str, wraps: tuple[str, ...] = (), max_len: int | None = None) -> None:
    """The tokenizer files of `path` for AutoTokenizer (see the module docstring); `wraps`: the specials a
    text is framed by ([CLS], [SEP]), `max_len`: the model's length (model_max_length)."""
    named = {key: token_name(tokenizer, name) for name, key in TOKEN_KEYS.items()
             if tokenizer.special_id(name) is not None}
    settings = {**named, **({"model_max_length": max_len} if max_len else {})}
    if isinstance(tokenizer, spm.SentencePieceTokenizer):
        shutil.copy(tokenizer.model_file, os.path.join(path, spm.MODEL_FILE))
        settings |= {"tokenizer_class": "T5Tokenizer", "extra_ids": tokenizer.extra_ids}
    else:
        fast = byte_tokenizer() if isinstance(tokenizer, ours.ByteTokenizer) else tokenizers.Tokenizer.from_str(
            tokenizer.tokenizer.to_str())
        if wraps and fast.post_processor is None and all(tokenizer.special_id(n) is not None for n in wraps):
            fast.post_processor = framing(tokenizer, *wraps)
        if wraps:  # a pair's second text has type id 1
            settings["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
        fast.save(os.path.join(path, ours.HF_FILE))
        settings |= {"tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(path, ours.CONFIG_FILE), "w") as f:
        json.dump(settings, f, indent=2)


def token_name(tokenizer, name: str) -> str:
    """The token a special's name stands for in `tokenizer` ('[BOS]' -> '<s>' in a model directory's)."""
    return tokenizer.specials.get(name, name)


def framing(tokenizer, first: str, last: str) -> processors.TemplateProcessing:
    """`first` text `last` (a pair: first A last B last, B's type id 1), as the BERT tasks frame texts."""
    a, b = token_name(tokenizer, first), token_name(tokenizer, last)
    return processors.TemplateProcessing(single=f"{a} $A {b}", pair=f"{a} $A {b} $B:1 {b}:1",
                                         special_tokens=[(a, tokenizer.special_id(first)),
                                                         (b, tokenizer.special_id(last))])


def byte_characters() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer turns each byte into)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    unused = iter(range(256, 512))
    return {b: chr(b if b in printable else next(unused)) for b in range(256)}


def byte_tokenizer() -> tokenizers.Tokenizer:
    """The byte tokenizer as a tokenizer.json: ids are the UTF-8 bytes of the text."""
    vocab = {c: b for b, c in byte_characters().items()}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer
