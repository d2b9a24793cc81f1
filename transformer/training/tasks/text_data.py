"""What a text task takes from its data: its tokenizer and the model's ids (`shapes` fills the keys in).

  data.tokenizer     a token store's tokenizer (lm, mlm); the config.init_from run's (a classifier
                     fine-tuning); else the task's own default for a text source (DEFAULT of lm, mlm,
                     classification)
  model.vocab_size   that tokenizer's ids: a store's index, a fixed tokenizer's size, a trained one's
                     config.data.vocab_size, the config.init_from run's model's
"""

import os

from transformer import rundir
from transformer.data.text import lm_streams, tokenizers
from transformer.data.text import sources as text_sources
from transformer.training import shapes, tasks


def built(config, stores: bool) -> bool:
    """Whether the run builds its tokenizer as config.data describes it: not a token store's (a task that
    reads `stores`), nor the one of the config.init_from run that a classifier fine-tunes with."""
    if stores:
        return lm_streams.store_indexes(config.data.source) is None
    return not config.init_from


def check_size(config) -> None:
    """The tokenizer config.data builds fits config.model.vocab_size."""
    size = tokenizers.expected_size(config.data, config.model.vocab_size)
    tokenizers.check_fits(size, config.data.tokenizer, config.model.vocab_size)


def from_data(config, taken: dict, default: str, text: str, held: str, stores: bool) -> list[str]:
    """Fills in data.tokenizer (else `default`) and model.vocab_size where config leaves them to the data
    (noted in `taken`); the lines that say what `text` (holding `held`) is tokenized by."""
    d, m = config.data, config.model
    if built(config, stores):
        shapes.take(config, taken, "data.tokenizer", default)
        kind = d.tokenizer
        ids = tokenizers.expected_size(d, m.vocab_size) or tokenizers.hf_tokenizer(d.tokenizer_path).vocab_size
        says = [f"data: {text}: {held}, tokenized by {kind} ({ids:,} ids"
                + (", trained on it)" if kind in ("bpe", "wordpiece") and not d.tokenizer_path else ")")]
    elif stores:
        indexes = lm_streams.store_indexes(d.source)
        kind, ids = indexes[0][1]["tokenizer"]["kind"], int(indexes[0][1]["vocab_size"])
        says = [f"data: {path}: a token store of {index['splits']['train']['tokens']:,} train tokens in "
                f"{index['splits']['train']['documents']:,} documents, tokenized by {index['tokenizer']['kind']} "
                f"({index['vocab_size']:,} ids)" for path, index in indexes]
    else:
        pretrained = rundir.open(config.init_from)
        kind, ids = pretrained.tokenizer(framed=False).kind, int(pretrained.config.model.vocab_size)
        says = [f"data: {text}: {held}", f"data: {config.init_from}'s tokenizer ({kind}) and its model's {ids:,} ids"]
    if stores and "document_mask" in d:
        says[-1] += ("; documents masked: each token attends within its own document" if d.document_mask else
                     "; documents not masked: a row's documents attend to each other (config.data.document_mask)")
    shapes.take(config, taken, "data.tokenizer", kind)
    if not shapes.take(config, taken, "model.vocab_size", ids) and m.vocab_size > ids:
        says.append(f"config.model.vocab_size={m.vocab_size}: the {kind} tokenizer has {ids:,} ids; the embedding's "
                    f"other {m.vocab_size - ids:,} rows are never read")
    return says


def stream_from_data(config, default: str) -> list[str]:
    """lm's and mlm's `from_data`: a token store's tokenizer and ids, else those of `default` on the text."""
    taken = {}
    return shapes.said(from_data(config, taken, default, config.data.source, "text", stores=True), taken)


def check_sources(config, workdir: str) -> None:
    """A text source of lm or mlm that the run in `workdir` has not tokenized yet names files: else it fails in
    one line, before anything is said of the data."""
    if tasks.name_of(config) in ("lm", "mlm") and lm_streams.store_indexes(config.data.source) is None and not \
            lm_streams.is_store(os.path.join(workdir, lm_streams.STORE_DIR)):
        text_sources.resolve_files(config.data.source)
