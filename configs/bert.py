"""BERT: masked-LM pretraining on the Python standard library, then fine-tuning from it.

Pretrain the tiny BERT (WordPiece trained on the stdlib, MLM), then fine-tune it on the two
embedded stdlib tasks (which package a function comes from; the token type of each token):

  python -m transformer.train --config configs/bert.py:tiny --workdir runs/bert-tiny
  python -m transformer.train --config configs/bert.py:tiny,task=sequence_classification \
      --config.init_from=runs/bert-tiny --workdir runs/bert-tiny-package
  python -m transformer.train --config configs/bert.py:tiny,task=token_classification \
      --config.init_from=runs/bert-tiny --workdir runs/bert-tiny-tokentype

The arg picks a preset (sizes in transformer/models/bert.py: tiny, longformer-tiny (4,096
tokens, a 256-token window and a global [CLS], blockwise), bert-base, bert-large)
and a task: mlm (default; `model.nsp=True` adds next-sentence prediction),
sequence_classification or token_classification (their own data through
`data.train_path` / `data.eval_path`: TSV `label<TAB>text` or CoNLL `token<TAB>tag`).
`init_from` copies the pretrained encoder (and tokenizer) into the fine-tuning run; the new
head starts fresh. A BERT vocab.txt: `data.tokenizer_path=DIR` with `data.tokenizer=wordpiece`.
The data decides what is '' or 0 here (transformer/training/shapes.py): `data.tokenizer` and
`model.vocab_size`, a token store's, init_from's, else a WordPiece of `data.vocab_size` ids (the
preset's) trained on the text; a classifier's `model.num_labels`, the distinct labels (tags) of
`data.train_path`, else the embedded task's. A `model.num_labels` you set must be at least those.

Every key's value, default and meaning: `python -m transformer.inspect --config configs/bert.py:tiny --keys`
(the meanings are transformer/config_keys.py's table).
"""

import ml_collections

from transformer import config as config_lib
from transformer.models import bert

# task -> the model head that it trains (models/bert.py names the task of each head); a classifier's
# labels are the data's (0: transformer/training/shapes.py).
TASKS = {task: dict(head=head) for head, task in bert.TASKS.items()}
for classifier in ("sequence_classification", "token_classification"):
    TASKS[classifier]["num_labels"] = 0

# Training settings per (preset, task); anything not listed takes the defaults below.
TRAINING = {
    ("tiny", "mlm"): dict(
        model=dict(dropout=0.0),
        data=dict(seq_len=64, batch_size=32, eval_batches=16),
        optim=dict(lr=2e-3, warmup_steps=70, b2=0.98, weight_decay=0.01),
        train=dict(steps=1200, log_every=25, eval_every=400, checkpoint_every=400),
    ),
    ("longformer-tiny", "mlm"): dict(
        model=dict(dropout=0.0),
        data=dict(seq_len=4096, batch_size=2, eval_batches=4),
        optim=dict(lr=2e-3, warmup_steps=50, b2=0.98, weight_decay=0.01),
        train=dict(steps=600, log_every=10, eval_every=200, checkpoint_every=100),
    ),
    ("tiny", "sequence_classification"): dict(
        data=dict(seq_len=128, batch_size=32, eval_batches=20),
        optim=dict(lr=5e-4, warmup_steps=30, weight_decay=0.01),
        train=dict(steps=300, log_every=25, eval_every=100, checkpoint_every=300),
    ),
    ("tiny", "token_classification"): dict(
        data=dict(seq_len=64, batch_size=32, eval_batches=40),
        optim=dict(lr=5e-4, warmup_steps=30, weight_decay=0.01),
        train=dict(steps=300, log_every=25, eval_every=100, checkpoint_every=300),
    ),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    preset, overrides = config_lib.parse_arg(arg, default_preset="tiny")
    task = overrides.pop("task", "mlm")
    if task not in TASKS:
        raise ValueError(f"unknown bert task {task!r}; choose one of {', '.join(TASKS)}")
    model = bert.default_model_config(preset)
    model.update(TASKS[task])
    trained_vocab, model["vocab_size"] = model["vocab_size"], 0  # the tokenizer's (transformer/training/shapes.py)
    c = ml_collections.ConfigDict()
    c.model = model
    c.data = dict(
        source="stdlib", text_field="text",
        tokenizer="",
        vocab_size=trained_vocab, tokenizer_path="", seq_len=min(512, model["max_len"]), batch_size=32,
        eval_fraction=0.02, eval_batches=8,
        train_path="",
        eval_path="",
        eval_source="", document_mask=False,
    )
    c.optim = config_lib.optim_config(lr=1e-4, warmup_steps=10_000, b2=0.999, weight_decay=0.01)
    c.train = config_lib.train_config(steps=1_000_000, eval_every=10_000, checkpoint_every=10_000)
    return config_lib.finish(c, TRAINING.get((preset, task), {}), overrides)
