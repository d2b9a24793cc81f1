"""What reads a transformers model directory's inputs, written from a run's: its tokenizer's files and
special-token ids, and an image classifier's preprocessor_config.json (`hf.save_pretrained` writes them).

The tokenizer's files encode as the run's tokenizer does:

  tokenizer.json (bpe, wordpiece, gpt2, hf)  itself, for PreTrainedTokenizerFast, its special tokens named in
      tokenizer_config.json; a BERT's adds [CLS] text [SEP] (the tasks' framing) where it has no post-processor
  byte                                       a tokenizer.json of the 256 bytes (id = byte value): a byte-level
      BPE without merges, so that any text encodes to its UTF-8 bytes and decodes back
  spiece.model (T5's sentencepiece)          itself, for T5Tokenizer, with the run's extra_ids

preprocessor_config.json, for AutoImageProcessor: a square image viewed as the run's eval view views it
(resized to S x S, bilinear; at config.data.crop_fraction < 1 to S / crop_fraction and its centre S x S
cropped, as DeiTImageProcessor does) and normalised by the run's statistics. A rectangular image it
resizes to S x S, where the run keeps its aspect and crops the centre. Read back (`image_settings`, on
import), such a file gives config.data its fixed statistics and crop_fraction.
"""

import json
import math
import os
import shutil

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from transformer.data.text import sentencepiece_tokenizer as spm
from transformer.data.text import tokenizers as ours

# Our names of the special tokens -> the keys transformers' tokenizer_config.json names them by.
TOKEN_KEYS = {"[PAD]": "pad_token", "[UNK]": "unk_token", "[CLS]": "cls_token", "[SEP]": "sep_token",
              "[MASK]": "mask_token", "[BOS]": "bos_token", "[EOS]": "eos_token"}


def save_image_processor(path: str, side: int, crop_fraction: float, mean, std) -> None:
    """preprocessor_config.json of the eval view at image size `side` (see the module docstring), normalised
    by mean [C] and std [C] of 0..255 pixels (there of pixels rescaled to 0..1)."""
    resized = math.floor(side / crop_fraction)
    crop = {"do_center_crop": True, "crop_size": {"height": side, "width": side}} if resized != side else {}
    settings = {"image_processor_type": "DeiTImageProcessor" if crop else "ViTImageProcessor",
                "do_resize": True, "size": {"height": resized, "width": resized}, "resample": 2,  # PIL's bilinear
                **crop, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "image_mean": [float(m) / 255 for m in mean], "image_std": [float(s) / 255 for s in std],
                "do_convert_rgb": len(mean) == 3}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(settings, f, indent=2)


def image_settings(hf_dir: str) -> dict:
    """config.data's {mean, std (0..255 pixels), crop_fraction} from the preprocessor_config.json of
    `hf_dir` (save_image_processor's inverse); {} without one."""
    path = os.path.join(hf_dir, "preprocessor_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        c = json.load(f)
    scale = 1 / c.get("rescale_factor", 1 / 255) if c.get("do_rescale", True) else 1.0
    settings = {"mean": tuple(float(m) * scale for m in c["image_mean"]),
                "std": tuple(float(s) * scale for s in c["image_std"])} if c.get("do_normalize", True) else {}
    size, crop = c.get("size", {}), c.get("crop_size", {})
    side = size.get("height", size.get("shortest_edge"))
    cropped = c.get("do_center_crop") and side and crop.get("height")
    return {**settings, "crop_fraction": crop["height"] / side if cropped else 1.0}


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


def byte_tokenizer() -> tokenizers.Tokenizer:
    """The byte tokenizer as a tokenizer.json: ids are the UTF-8 bytes of the text."""
    vocab = {c: b for b, c in ours.byte_characters().items()}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer
