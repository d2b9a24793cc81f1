"""Encoder-decoder (sequence to sequence) training, "Attention is all you need" style.

Train the tiny preset on the embedded code2doc task (stdlib function code -> the first
line of its docstring, built into WORKDIR/data on the first run; CPU, minutes):

  python -m transformer.train --config configs/encdec.py:tiny --workdir runs/encdec-tiny

then summarise code with it:

  python -m transformer.generate --workdir runs/encdec-tiny --input "def add(a, b): \\n return a + b"

Presets (model sizes live in transformer/models/encdec.py): tiny, vaswani-base, and T5's
t5-small, t5-base, t5-v1_1-small (sources end in [EOS]: `data.source_eos`, T5's `</s>`).
Your own pairs: `--config.data.train_path=train.tsv --config.data.eval_path=eval.tsv` (TSV
`source<TAB>target`). A converted T5 (`python -m transformer.convert`) fine-tunes from
`configs/encdec.py:t5-small` with `--config.init_from=RUN` (the command is printed).

Every key's value, default and meaning: `python -m transformer.inspect --config configs/encdec.py:tiny --keys`
(the meanings are transformer/config_keys.py's table).
"""

import ml_collections

from transformer import config as config_lib
from transformer.models import encdec

# Training settings per preset; anything not listed takes the defaults below.
TRAINING = {
    "tiny": dict(
        data=dict(source_len=64, target_len=24, batch_size=32, eval_batches=8),
        optim=dict(lr=1.5e-3, warmup_steps=100, weight_decay=0.01),
        train=dict(steps=2400, log_every=25, eval_every=600, checkpoint_every=600),
    ),
}
# T5 fine-tuning: sources end in </s>; AdamW at 1e-4 (T5 itself used Adafactor)
T5 = dict(data=dict(source_eos=True, source_len=512, target_len=128), optim=dict(lr=1e-4, warmup_steps=500),
          train=dict(label_smoothing=0.0))
TRAINING.update({"t5-small": T5, "t5-base": T5, "t5-v1_1-small": T5})


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    preset, overrides = config_lib.parse_arg(arg, default_preset="tiny")
    model = encdec.default_model_config(preset)
    c = ml_collections.ConfigDict()
    c.model = model
    c.data = dict(
        train_path="",
        eval_path="",
        tokenizer="bpe", vocab_size=0, tokenizer_path="",
        source_eos=False,
        source_len=min(256, model["max_len"]),
        target_len=min(64, model["max_len"]),
        batch_size=64, eval_batches=4,
    )
    c.optim = config_lib.optim_config(lr=7e-4, warmup_steps=4000, b2=0.98, weight_decay=0.0)
    c.train = config_lib.train_config(steps=100_000, eval_every=2000, checkpoint_every=2000,
                                      label_smoothing=0.1,
                                      eval_beam_size=1,
                                      eval_length_penalty=0.6)
    return config_lib.finish(c, TRAINING.get(preset, {}), overrides)
