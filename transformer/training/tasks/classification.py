"""What the BERT tasks share: the run's tokenizer, label ids, batches and classification metrics.

Glossary of shapes: B batch, L seq_len, N examples, C classes.

A labelled example is encoded into fixed-length rows: tokens int32 [L] ([CLS] ... [SEP],
[PAD]-filled), valid bool [L], labels int32 [] (a sequence) or [L] (tokens); a label of
IGNORE (`labelled.IGNORE`) is left out of the loss and the metrics (padding, later sub-tokens, padded eval rows).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from transformer import models, rundir, sharding
from transformer.data.text import labelled, tokenizers
from transformer.layers import cross_entropy
from transformer.training import losses, shapes, tasks
from transformer.training.tasks import text_data


def run_tokenizer(config, workdir: str, texts_fn):
    """The run's tokenizer: the workdir's (resume), else the `config.init_from` run's (copied in), else built.

    A fine-tuning run must read text with the ids its pretrained embeddings were trained on.
    """
    if config.init_from and not os.path.isfile(os.path.join(workdir, tokenizers.CONFIG_FILE)):
        tokenizers.load_tokenizer(config.init_from).save(workdir)
    return tokenizers.build_tokenizer(config.data, workdir, texts_fn, config.model.vocab_size)


def check(config) -> None:
    """The config checks of both labelling tasks."""
    tasks.check_lengths(config, "seq_len")
    tasks.check_specials(config, "[CLS]", "[SEP]")
    if text_data.built(config, stores=False):
        text_data.check_size(config)


SHOWN_LABELS = 8  # label names said in the run's first lines


def from_data(config, embedded: tuple[str, int, str], read) -> list[str]:
    """Both labelling tasks' `from_data`: the tokenizer and ids (`text_data`, a text source's default 'wordpiece',
    or the config.init_from run's) and model.num_labels, the distinct labels of config.data.train_path as
    `read(path) -> (labels, what the file holds)` gives them (or the init_from head's), else the embedded
    task's (`embedded`: its name, number of labels and what they are)."""
    text, held, labels = _labels(config, embedded, read)
    taken, m = {}, config.model
    says = text_data.from_data(config, taken, "wordpiece", text, held, stores=False)
    if not shapes.take(config, taken, "model.num_labels", labels):
        if m.num_labels < labels:
            raise ValueError(f"config.model.num_labels={m.num_labels} but {text} holds {labels} labels: raise it, or "
                             "leave it out (the data's)")
        if m.num_labels > labels:
            says.append(f"config.model.num_labels={m.num_labels}: {text} holds {labels} labels; the head's other "
                        f"{m.num_labels - labels} outputs are never a target")
    return shapes.said(says, taken)


def _labels(config, embedded: tuple[str, int, str], read) -> tuple[str, str, int]:
    """Where a classifier's labelled text is, what it holds and its number of labels."""
    paths = given_paths(config.data)
    if paths is None:
        name, count, what = embedded
        return f"the embedded {name} task", f"{count} labels ({what})", count
    path = paths["train"]
    labels, held = read(path)
    names = names_for(config, labels, path)
    shown = ", ".join(names[:SHOWN_LABELS]) + (", ..." if len(names) > SHOWN_LABELS else "")
    order = "" if names == names_of(labels) else ": the ids of config.init_from's head"
    return path, f"{held}, {len(names)} labels ({shown}{order})", len(names)


def names_of(train_labels) -> list[str]:
    """The label names by id: the train data's distinct labels, sorted."""
    return sorted(set(train_labels))


def head_names(config) -> list[str] | None:
    """The label names by id of the config.init_from run where it is a classifier of this run's task that
    recorded them (its labels.json: a converted model's id2label keeps its own order); init_from loads its
    head, so each id keeps its label. None for any other run (a pretrained encoder, another task, a
    converted model's LABEL_0, LABEL_1, ...)."""
    head = rundir.read_labels(config.init_from) if config.init_from else None
    if head is None:
        return None
    return head if rundir.open(config.init_from).classifies == models.task_of(config.model) else None


def names_for(config, train_labels, path: str) -> list[str]:
    """A new run's label names by id: its config.init_from head's (`head_names`) where they hold every train
    label, each id keeping its label; else the train data's (`names_of`), for a new head (`new_head`), as
    transformers' ignore_mismatched_sizes starts one."""
    head, names = head_names(config), names_of(train_labels)
    return head if head is not None and set(names) <= set(head) else names


def new_head(config, names: list[str]) -> str:
    """Why the run starts a new head rather than the config.init_from classifier's: that head is another task's,
    or its labels are not this run's label `names` (other names in its labels.json, or another number of
    outputs); '' where it carries over, or where config.init_from has no classifier head."""
    if not config.init_from:
        return ""
    pretrained = rundir.open(config.init_from).config.model
    if pretrained.get("head") not in ("sequence", "token"):
        return ""
    theirs, ours = models.task_of(pretrained), models.task_of(config.model)
    head = rundir.read_labels(config.init_from)
    if theirs != ours:
        return f"its head is for {theirs}, this run's for {ours}"
    if head is not None and head != names:
        return f"its labels are {_shown(head)}, this run's {_shown(names)}"
    if pretrained.num_labels != len(names):
        return f"its head has {pretrained.num_labels} outputs, this run's data {len(names)} labels"
    return ""


def _shown(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


def head_weights(model_config) -> list[str]:
    """The paths ('classifier/kernel') of the weights of a classifier's outputs: those on the CLASSES axis."""
    boxed = traverse_util.flatten_dict(models.param_shapes(model_config), sep="/")
    return [name for name, leaf in boxed.items() if sharding.CLASSES in getattr(leaf, "names", ())]


def label_names(config, workdir: str, train_labels, path: str) -> list[str]:
    """The run's label names (`names_for` the train data's labels, from `path`), saved in workdir/labels.json
    (resume and eval reuse it). A new run's config.model.num_labels has been checked against them
    (`from_data`); an evaluated run's head with fewer outputs fails naming `path`."""
    saved = rundir.read_labels(workdir)
    if saved is not None:
        return saved
    names = names_for(config, train_labels, path)
    if len(names) > config.model.num_labels:  # a trained head read with other data: evaluate
        raise ValueError(f"{path} holds {len(names)} labels ({_shown(names)}), more than the model's "
                         f"{config.model.num_labels} outputs: evaluate on data of its labels, or fine-tune a new "
                         "head on these (config.init_from)")
    rundir.save_labels(workdir, names)
    return names


def label_ids(labels, names: list[str], path: str) -> list[int]:
    """Ids of `labels`; a label the run does not have (its train data's, or a converted model's) fails naming
    the file."""
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted(set(labels) - set(index))
    if unknown:
        raise ValueError(f"{path}: labels {', '.join(unknown[:5])} are not among the run's labels {names} "
                         f"({rundir.LABELS})")
    return [index[label] for label in labels]


class Batches:
    """Train batches drawn at random, a pure function of (seed, step); eval batches fixed, in order;
    each of them this process's `rows` of the global batch."""

    def __init__(self, train: dict, eval_: dict, data_config, seed: int, rows: np.ndarray):
        self.train, self.seed, self.global_batch = train, seed, data_config.batch_size
        self._rows = rows
        self._eval = self._eval_batches(eval_, data_config.eval_batches)

    def train_batch(self, step: int) -> dict:
        rng = np.random.default_rng([self.seed, step])
        index = rng.integers(0, len(self.train["tokens"]), self.global_batch)[self._rows]
        return {k: v[index] for k, v in self.train.items()}

    def _eval_batches(self, eval_: dict, max_batches: int) -> list[dict]:
        """The first `max_batches` global batches of the eval set, the last filled with labelled.IGNORE rows."""
        n = min(len(eval_["tokens"]), max_batches * self.global_batch)
        padded = -(-n // self.global_batch) * self.global_batch
        def pad(name, x):
            fill = np.full((padded - n, *x.shape[1:]), labelled.IGNORE if name == "labels" else 0, x.dtype)
            return np.concatenate([x[:n], fill])
        arrays = {k: pad(k, v) for k, v in eval_.items()}
        return [{k: v[i:i + self.global_batch][self._rows] for k, v in arrays.items()}
                for i in range(0, padded, self.global_batch)]

    def eval_batches(self) -> list[dict]:
        return self._eval




def macro_f1(pred: np.ndarray, label: np.ndarray) -> float:
    """Mean F1 over the classes that occur in `label` or `pred`."""
    scores = []
    for c in np.union1d(pred, label):
        tp = np.sum((pred == c) & (label == c))
        denominator = np.sum(pred == c) + np.sum(label == c)
        scores.append(2 * tp / denominator)
    return float(np.mean(scores))


class LabelledTask:
    """Sequence or token classification: subclasses provide `head` and `_encode(path, names)`.

    `_encode` returns arrays tokens [N, L], valid [N, L] and labels [N] or [N, L].
    """

    item_name = "tokens"

    def __init__(self, config, train: dict, eval_: dict, names: list[str], rows: np.ndarray):
        self.config, self.names = config, names
        self.new_head = new_head(config, names)  # why config.init_from's head does not carry over ('' where it does)
        self.items_per_step = config.data.batch_size * config.data.seq_len
        self.data = Batches(train, eval_, config.data, config.train.seed, rows)
        counts = np.bincount(train["labels"][train["labels"] != labelled.IGNORE], minlength=len(names))
        self.majority = int(np.argmax(counts))

    def init_inputs(self):
        shape = (1, self.config.data.seq_len)
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.int32), jnp.ones(shape, bool)

    def train_batch(self, step: int) -> dict:
        return self.data.train_batch(step)

    def eval_batches(self) -> list[dict]:
        return self.data.eval_batches()

    def _logits(self, model, params, batch, **kwargs) -> jax.Array:
        return model.apply({"params": params}, batch["tokens"], None, batch["valid"], **kwargs)["logits"]

    def loss(self, model, params, batch, rng):
        logits = self._logits(model, params, batch, deterministic=False, rngs={"dropout": rng})
        labels = batch["labels"]
        loss = losses.mean(losses.cross_entropy(logits, jnp.maximum(labels, 0), labels != labelled.IGNORE))
        return loss, {"loss": loss}

    def loss_weights(self, batch) -> dict:
        return {"loss": (batch["labels"] != labelled.IGNORE).sum()}

    def eval_outputs(self, model, params, batch) -> dict:
        logits = self._logits(model, params, batch)
        # labelled.IGNORE rows dropped on the host
        per_item = cross_entropy.token_losses(logits, jnp.maximum(batch["labels"], 0))
        return {"loss": per_item, "pred": jnp.argmax(logits, -1), "label": batch["labels"]}

    def eval_metrics(self, outputs: list[dict]) -> dict:
        label = np.concatenate([np.ravel(o["label"]) for o in outputs])
        keep = label != labelled.IGNORE
        label = label[keep]
        pred = np.concatenate([np.ravel(o["pred"]) for o in outputs])[keep]
        loss = np.concatenate([np.ravel(o["loss"]) for o in outputs])[keep]
        return {"eval/loss": float(loss.mean()), "eval/accuracy": float(np.mean(pred == label)),
                "eval/macro_f1": macro_f1(pred, label),
                "eval/majority_accuracy": float(np.mean(label == self.majority))}

    def report(self, model, params, step: int) -> list[str]:
        return []


def given_paths(data_config) -> dict[str, str] | None:
    """config.data.train_path / eval_path, each a file; None where both are '' (the embedded task)."""
    if not (data_config.train_path or data_config.eval_path):
        return None
    for key in ("train_path", "eval_path"):
        if not os.path.isfile(os.path.expanduser(data_config[key])):
            raise FileNotFoundError(f"config.data.{key}={data_config[key]!r} is not a file")
    return {"train": data_config.train_path, "eval": data_config.eval_path}


def data_paths(config, workdir: str, prepare) -> dict[str, str]:
    """`given_paths`, or the embedded default task written into workdir/data (deterministic: a resumed run
    gets the same files)."""
    return given_paths(config.data) or prepare(os.path.join(workdir, "data"))
