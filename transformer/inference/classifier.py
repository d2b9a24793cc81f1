"""A trained classifier as a function of raw inputs: BERT sequence and token classification, ViT images.

    from transformer import rundir
    from transformer.inference import classifier
    classify = classifier.Classifier(rundir.open("runs/bert-reviews"))     # the latest checkpoint; step=N for another
    classify(["a gripping film", "dull and long"])
    # [{'label': 'pos', 'probabilities': {'pos': 0.93, 'neg': 0.07}}, {'label': 'neg', ...}]

A sequence classifier takes texts; a token classifier texts (split into words at whitespace) or lists of
words, and gives each word that fits in config.data.seq_len {'word', 'label', 'probabilities'} (read at
the word's first sub-token, as its training scored it); a ViT takes image files (any format PIL reads, or
.npy) or uint8 arrays [H, W, C], viewed as its eval views them and normalised by the run's statistics.
'probabilities' are every label's, most likely first (`top_k` > 0: that many). `read_inputs`
reads a file of inputs as `python -m transformer.predict` takes them. Label names are the run's
(`rundir.RunDir.labels`): WORKDIR/labels.json, the class folders of an image folder, else the ids as text.

Glossary of shapes: N inputs, B a chunk of them, L seq_len, C classes, S image size.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np

from transformer import models
from transformer.data.images import batches, folders, host_views, normalisation
from transformer.data.text import labelled, tokenizers

CHUNK = 32  # inputs per forward pass (a fixed shape: one compile)


def refusal(run) -> str:
    """Why the run cannot predict labels, and what to run instead, in one line."""
    family = run.family
    if family.generation:
        return (f"{family.name} models do not classify: generate with python -m transformer.generate "
                f"--workdir {run.path} --{family.generation} TEXT, or score them with python -m transformer.evaluate "
                f"--workdir {run.path}")
    return (f"this {family.name} model does not classify (task {models.task_of(run.config.model)!r}): score it with "
            f"python -m transformer.evaluate --workdir {run.path}, or fine-tune a classifier from it with "
            "config.init_from")


class Classifier:
    """A run's classifier at one checkpoint: `classifier(inputs)` -> one prediction per input."""

    def __init__(self, run, step: int | None = None, top_k: int = 0):
        self.task = run.classifies
        if self.task is None:
            raise ValueError(refusal(run))
        self.run, self.config, self.top_k = run, run.config, top_k
        self.labels = run.labels
        self.model = run.model()
        self.step = run.latest_step if step is None else step
        self.params = run.restore_params(step)
        self.tokenizer = None if self.task == "image_classification" else run.tokenizer(framed=False)
        self._apply = jax.jit(self.model.apply)

    def __call__(self, inputs) -> list[dict]:
        if self.task == "image_classification":
            return self._images(inputs)
        if self.task == "sequence_classification":
            return self._texts(inputs)
        return self._words(inputs)

    def logits(self, *arrays: np.ndarray) -> np.ndarray:
        """The model's logits (float32) of inputs arrays [N, ...], run in padded chunks of CHUNK."""
        out = []
        for start in range(0, len(arrays[0]), CHUNK):
            chunk = [a[start:start + CHUNK] for a in arrays]
            n = len(chunk[0])
            padded = [np.concatenate([a, np.zeros((CHUNK - n, *a.shape[1:]), a.dtype)]) for a in chunk]
            logits = self._apply({"params": self.params}, *padded)
            out.append(np.asarray(logits["logits"] if isinstance(logits, dict) else logits)[:n])
        return np.concatenate(out)

    def prediction(self, logits: np.ndarray) -> dict:
        """{'label', 'probabilities'} of one input's logits [C]."""
        p = np.asarray(jax.nn.softmax(jnp.asarray(logits, jnp.float32)))
        order = np.argsort(-p, kind="stable")[:self.top_k or None]
        return {"label": self.labels[order[0]], "probabilities": {self.labels[i]: round(float(p[i]), 6) for i in order}}

    def _texts(self, texts: list[str]) -> list[dict]:
        cls, sep = (tokenizers.require_special(self.tokenizer, n) for n in ("[CLS]", "[SEP]"))
        pieces = [self.tokenizer.encode(text).tolist() for text in texts]
        tokens, valid = labelled.frame(pieces, self.config.data.seq_len, cls, sep)
        return [self.prediction(row) for row in self.logits(tokens, np.zeros_like(tokens), valid)]

    def _words(self, sentences) -> list[dict]:
        cls, sep, unk = (tokenizers.require_special(self.tokenizer, n) for n in ("[CLS]", "[SEP]", "[UNK]"))
        sentences = [s.split() if isinstance(s, str) else list(s) for s in sentences]
        seq_len, pieces, firsts = self.config.data.seq_len, [], []
        for words in sentences:
            ids, marks = labelled.align([self.tokenizer.encode(w).tolist() for w in words],
                                                    [0] * len(words), seq_len, unk)
            pieces.append(ids)
            firsts.append(1 + np.flatnonzero(np.asarray(marks) != labelled.IGNORE))  # after [CLS]
        tokens, valid = labelled.frame(pieces, seq_len, cls, sep)
        logits = self.logits(tokens, np.zeros_like(tokens), valid)  # [N, L, C]
        return [{"words": [{"word": w, **self.prediction(row[i])} for w, i in zip(words, at)],
                 "words_cut": len(words) - len(at)} for words, at, row in zip(sentences, firsts, logits)]

    def _images(self, images) -> list[dict]:
        recipe = host_views.Recipe.of(self.config)
        views = np.stack([batches.read_image(x, self.config) if isinstance(x, (str, os.PathLike))
                          else host_views.eval_view(np.asarray(x), recipe) for x in images])  # [N, S, S, C]
        mean, std = self.statistics()
        return [self.prediction(row) for row in self.logits(normalisation.normalise(views, mean, std))]

    def statistics(self) -> tuple[np.ndarray, np.ndarray]:
        """The per-channel mean [C] and std [C] the run normalised its images by."""
        saved = normalisation.recorded_statistics(self.config.data, self.run.path)
        if saved is None:
            raise FileNotFoundError(f"{self.run.path}/{folders.INDEX_DIR}/{normalisation.STATISTICS} not found: the "
                                    "run recorded no image statistics (train it, or set config.data.mean and std)")
        return saved


def read_inputs(task: str, path: str) -> tuple[list, list[str]]:
    """(inputs, their targets: [] where the file has none) of a file of inputs for `task`, as `python -m
    transformer.predict --input` takes it (`folders.input_images`, `labelled.read_inputs`)."""
    path = os.path.expanduser(path)
    return (folders.input_images(path), []) if task == "image_classification" else labelled.read_inputs(task, path)
