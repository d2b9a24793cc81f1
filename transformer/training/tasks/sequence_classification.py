"""Sequence classification: one label per text, predicted from the pooled [CLS] position.

Glossary of shapes: B batch, L seq_len, C classes. Data: TSV `label<TAB>text` files
(config.data.train_path / eval_path); left empty, the embedded `package` task (which stdlib
package a function comes from) is written into WORKDIR/data. A batch is tokens, valid
[B, L] ([CLS] text [SEP], cut to L) and labels [B]; label ids are the train file's sorted
labels, or fine-tuning a sequence classifier (config.init_from) its head's, kept in
WORKDIR/labels.json.
"""

import numpy as np

from transformer.data.text import labelled, tokenizers
from transformer.training.tasks import classification

check = classification.check
EMBEDDED = ("package", labelled.NUM_PACKAGES, "stdlib packages")  # the embedded task: name, labels, what they are


def train_labels(path: str) -> tuple[list[str], str]:
    """A TSV's labels, one per text, and what it holds."""
    examples = labelled.read_labelled(path)
    return [label for label, _ in examples], f"{len(examples):,} labelled texts"


def from_data(config) -> list[str]:
    return classification.from_data(config, EMBEDDED, train_labels)


class SequenceClassificationTask(classification.LabelledTask):
    def __init__(self, config, workdir: str, rows: np.ndarray):
        paths = classification.data_paths(config, workdir, labelled.prepare_package)
        examples = {split: labelled.read_labelled(path) for split, path in paths.items()}
        self.tokenizer = classification.run_tokenizer(config, workdir,
                                                      lambda: (text for _, text in examples["train"]))
        names = classification.label_names(config, workdir, [label for label, _ in examples["train"]], paths["train"])
        train, eval_ = (self._encode(examples[s], names, paths[s], config.data.seq_len) for s in ("train", "eval"))
        super().__init__(config, train, eval_, names, rows)

    def _encode(self, examples, names, path: str, seq_len: int) -> dict:
        cls, sep = (tokenizers.require_special(self.tokenizer, n) for n in ("[CLS]", "[SEP]"))
        tokens, valid = labelled.frame([self.tokenizer.encode(text).tolist() for _, text in examples],
                                       seq_len, cls, sep)
        labels = classification.label_ids([label for label, _ in examples], names, path)
        return {"tokens": tokens, "valid": valid, "labels": np.asarray(labels, np.int32)}


def build(config, workdir: str, rows: np.ndarray, start_step: int) -> SequenceClassificationTask:
    return SequenceClassificationTask(config, workdir, rows)
