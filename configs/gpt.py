"""GPT (decoder-only) language modelling.

Train the default tiny byte-level GPT on the Python standard library (CPU, minutes):

  python -m transformer.train --config configs/gpt.py:tiny --workdir runs/gpt-tiny

Presets (model sizes live in transformer/models/gpt.py): tiny, tiny-moe (tiny with a mixture of 8
experts, 2 per token, in every Block: train/moe/* shows the router's losses and the experts' load),
tiny-long (65,536 tokens of context, blockwise attention; eval reports the loss by position),
gpt2-small, gpt2-medium, gpt2-large, gpt2-xl, gpt3-175b, and ImageGPT's igpt-tiny (the 8 x 8 digits in a
palette of 16 greys, CPU minutes), igpt-s, igpt-m, igpt-l (32 x 32, 512 colours) and igpt-xl (64 x 64):
an image `data.source` (digits, .npz, IDX files, a folder of class folders) makes a GPT read pixels
(transformer/training/tasks/image_lm.py), e.g.

  python -m transformer.train --config configs/gpt.py:igpt-tiny --workdir runs/igpt-tiny
  python -m transformer.train --config configs/gpt.py:igpt-s,data.source=~/cifar10 --workdir runs/igpt-s

Override in the arg
(`configs/gpt.py:gpt2-small,optim.lr=6e-4`) or with flags (`--config.optim.lr=6e-4`).
A preset named after a published model (gpt2-*, gpt3-175b, llama3-*, mistral-7b, mixtral-8x7b, qwen3-*)
keeps that model's vocabulary and tokenizer: GPT-2's BPE (`data.tokenizer=gpt2`, its files in
`data.tokenizer_path`) or the model's own Hugging Face tokenizer (`data.tokenizer=hf`, its folder in
`data.tokenizer_path`). The generic sizes (tiny, tiny-moe, tiny-long, llama-tiny) leave `data.tokenizer` and
`model.vocab_size` to the data ('' and 0; transformer/training/shapes.py): a token store's tokenizer and
ids (`configs/gpt.py:tiny,data.source=STORE` is all a store needs), or for text the byte tokenizer's 256.
A published preset takes the data's too where its arg names `data.tokenizer` or a token store as
`data.source` (`configs/gpt.py:gpt2-small,data.source=STORE`), unless it names `model.vocab_size`.

Every key's value, default and meaning: `python -m transformer.inspect --config configs/gpt.py:tiny --keys`
(the meanings are transformer/config_keys.py's table).
"""

import ml_collections

from transformer import config as config_lib
from transformer.data.text import lm_streams
from transformer.models import gpt

# the tokenizer of each preset named after a published model (its vocab_size is that model's)
PUBLISHED = {name: "gpt2" if name.startswith("gpt") else "hf" for name in gpt.PRESETS
             if "tiny" not in name and not name.startswith("igpt")}  # ImageGPT's palette comes from its images

# Training settings per preset; anything not listed takes the defaults below.
TINY = dict(
    data=dict(seq_len=128, batch_size=16, eval_batches=16),
    optim=dict(lr=4e-3, warmup_steps=50, weight_decay=0.1),
    train=dict(steps=1600, log_every=25, eval_every=400, checkpoint_every=400, sample_tokens=120),
)
TRAINING = {
    "tiny": TINY,
    "tiny-moe": TINY,
    "tiny-long": dict(
        data=dict(seq_len=65536, batch_size=1, eval_batches=2),
        optim=dict(lr=2e-3, warmup_steps=20, weight_decay=0.1),
        train=dict(steps=300, log_every=1, eval_every=100, checkpoint_every=25, sample_tokens=0),
    ),
    "gpt3-175b": dict(data=dict(seq_len=2048)),
    "igpt-tiny": dict(
        data=dict(source="digits", image_side=8, palette_size=16, seq_len=64, batch_size=32, eval_batches=16,
                  eval_fraction=0.2),
        optim=dict(lr=2e-3, warmup_steps=100, weight_decay=0.01),
        train=dict(steps=1000, log_every=50, eval_every=250, checkpoint_every=250, sample_tokens=64),
    ),
    **{name: dict(data=dict(source="digits", image_side=side, seq_len=side * side, eval_fraction=0.2),
                  train=dict(sample_tokens=side * side))
       for name, side in (("igpt-s", 32), ("igpt-m", 32), ("igpt-l", 32), ("igpt-xl", 64))},
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    preset, overrides = config_lib.parse_arg(arg, default_preset="tiny")
    model = gpt.default_model_config(preset)
    tokenizer = published_tokenizer(preset, overrides)
    if not tokenizer:
        model["vocab_size"] = 0   # the tokenizer's ids (transformer/training/shapes.py)
    c = ml_collections.ConfigDict()
    c.model = model
    c.data = dict(
        source="stdlib",
        text_field="text",
        tokenizer=tokenizer,
        vocab_size=0,
        tokenizer_path="",
        seq_len=min(1024, model["max_len"]),
        batch_size=8,
        eval_fraction=0.02,
        eval_batches=8,
        eval_source="",
        document_mask=False,
        image_side=64,
        palette_size=512,
    )
    c.optim = config_lib.optim_config(lr=6e-4, warmup_steps=2000)
    c.train = config_lib.train_config(steps=100_000, eval_every=1000, checkpoint_every=1000,
                                      sample_tokens=200)
    return config_lib.finish(c, TRAINING.get(preset, {}), overrides)


def published_tokenizer(preset: str, overrides: dict) -> str:
    """The tokenizer `preset` keeps (its model's), or '' where the data gives it: a generic size, or an arg
    that names another tokenizer or a token store and leaves the vocabulary to it."""
    if preset not in PUBLISHED or "model.vocab_size" in overrides:
        return PUBLISHED.get(preset, "")
    if "data.tokenizer" in overrides or lm_streams.store_indexes(overrides.get("data.source", "")):
        return ""
    return PUBLISHED[preset]
