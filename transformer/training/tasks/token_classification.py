"""Token classification: one tag per word, predicted at the word's first sub-token.

Glossary of shapes: B batch, L seq_len, C classes. Data: CoNLL `token<TAB>tag` files
(config.data.train_path / eval_path); left empty, the embedded `tokentype` task (the
`tokenize` type of each token of stdlib source lines) is written into WORKDIR/data. Each
word is tokenized on its own; its tag sits on its first sub-token and the other sub-tokens
are left out of the loss and the metrics (label `labelled.IGNORE`), so accuracy and macro F1 are over
words (those that fit in L). Tag ids are the train file's sorted tags, or fine-tuning a token
classifier (config.init_from) its head's, kept in WORKDIR/labels.json.
"""

import numpy as np

from transformer.data.text import labelled, tokenizers
from transformer.training.tasks import classification

check = classification.check
EMBEDDED = ("tokentype", len(labelled.TAGS), ", ".join(sorted(labelled.TAGS)))  # the embedded task's name, tags


def train_labels(path: str) -> tuple[list[str], str]:
    """A CoNLL file's tags, one per word, and what it holds."""
    sentences = labelled.read_conll(path)
    held = f"{len(sentences):,} tagged sentences ({sum(len(words) for words, _ in sentences):,} words)"
    return [tag for _, tags in sentences for tag in tags], held


def from_data(config) -> list[str]:
    return classification.from_data(config, EMBEDDED, train_labels)


class TokenClassificationTask(classification.LabelledTask):
    def __init__(self, config, workdir: str, rows: np.ndarray):
        paths = classification.data_paths(config, workdir, labelled.prepare_tokentype)
        sentences = {split: labelled.read_conll(path) for split, path in paths.items()}
        self.tokenizer = classification.run_tokenizer(config, workdir,
                                                      lambda: (" ".join(words) for words, _ in sentences["train"]))
        names = classification.label_names(config, workdir, [t for _, tags in sentences["train"] for t in tags],
                                            paths["train"])
        train, eval_ = (self._encode(sentences[s], names, paths[s], config.data.seq_len) for s in ("train", "eval"))
        super().__init__(config, train, eval_, names, rows)

    def _encode(self, sentences, names, path: str, seq_len: int) -> dict:
        cls, sep, unk = (tokenizers.require_special(self.tokenizer, n) for n in ("[CLS]", "[SEP]", "[UNK]"))
        pieces, labels = [], np.full((len(sentences), seq_len), labelled.IGNORE, np.int32)
        for row, (words, tags) in zip(labels, sentences):
            ids, word_labels = labelled.align([self.tokenizer.encode(w).tolist() for w in words],
                                     classification.label_ids(tags, names, path), seq_len, unk)
            pieces.append(ids)
            row[1:1 + len(word_labels)] = word_labels
        tokens, valid = labelled.frame(pieces, seq_len, cls, sep)
        return {"tokens": tokens, "valid": valid, "labels": labels}


def build(config, workdir: str, rows: np.ndarray, start_step: int) -> TokenClassificationTask:
    return TokenClassificationTask(config, workdir, rows)
