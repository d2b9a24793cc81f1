"""The shapes a run takes from its data: the config keys a config file leaves to the data, filled in once.

A config file leaves a key to the data by giving it its value in FROM_DATA (0, or '' for the
tokenizer); any other value, from the config's arg, a --config.KEY flag or Python, is the user's and
stays. `resolve` fills them in before the model is built (`loop.setup`; config.json then holds the
real shape, which a resumed run, evaluate and predict read) and says what the data holds and what
the run took from it. A key the user set that the data contradicts is said in one line where the
run still works; where it cannot, the run fails in one line naming the key (here, or in the task's
checks: a store's other tokenizer, more ids than the embedding has rows).

  task                   key                 from the data
  lm, mlm                data.tokenizer      a token store's tokenizer; a text source's TEXT_TOKENIZERS
                         model.vocab_size    that tokenizer's ids: a store's index, a fixed tokenizer's
                                             size, a trained one's config.data.vocab_size
  sequence_/token_       the same            the config.init_from run's tokenizer and vocab_size, else as
  classification                             for a text source
                         model.num_labels    the distinct labels of data.train_path (its TSV labels, its
                                             CoNLL tags), or the labels of the config.init_from classifier
                                             whose head it loads (`classification.names_for`), else the
                                             embedded task's (EMBEDDED)
  image_classification   model.num_classes   the source's classes: its class folders, else its labels' largest + 1
                         model.channels      3 where a sampled image has colour, else 1 (arrays: their C)
                         model.image_size    the images' median shorter side, rounded to a multiple of
                                             patch_size, from one patch to LARGEST_SIDE and MOST_PATCHES a side
"""

import copy

import numpy as np

from transformer import config as config_lib
from transformer import models, rundir
from transformer.data.images import pixels
from transformer.data.images import sources as image_sources
from transformer.data.text import labelled, lm_streams, tokenizers
from transformer.training.tasks import classification, image_lm

FROM_DATA = {"data.tokenizer": "", "model.vocab_size": 0, "model.num_classes": 0, "model.channels": 0,
             "model.image_size": 0, "model.num_labels": 0}
TEXT_TOKENIZERS = {"lm": "byte", "mlm": "wordpiece", "sequence_classification": "wordpiece",
                   "token_classification": "wordpiece"}
LARGEST_SIDE = 224  # ImageNet's: larger images are viewed at this side
MOST_PATCHES = 24   # patches along a side
COLOUR = {1: "grayscale", 3: "RGB"}
# a classifier's embedded task (data.train_path ''): its name, its number of labels and what they are
EMBEDDED = {"sequence_classification": ("package", labelled.NUM_PACKAGES, "stdlib packages"),
            "token_classification": ("tokentype", len(labelled.TAGS), ", ".join(sorted(labelled.TAGS)))}
SHOWN_LABELS = 8  # label names said in the run's first lines


def left_to_data(config) -> list[str]:
    """The keys of `config` that it leaves to the data."""
    values = config_lib.leaves(config)
    return [key for key, value in FROM_DATA.items() if key in values and values[key] == value]


def resolve(config) -> list[str]:
    """Fills in the keys `config` leaves to the data, in place; returns the lines that say what the data
    holds, what was taken from it and where a key the user set disagrees with it."""
    task = models.task_of(config.model)
    if task == "image_classification":
        return _images(config)
    if task == "lm" and pixels.is_image_source(config.data.source):
        return image_lm.from_data(config)
    return _text(config, task) if task in TEXT_TOKENIZERS else []


def resolved(config, say=None):
    """`config` with the keys it leaves to the data filled in, a copy where it leaves any (each line of
    `resolve` passed to `say`, where given)."""
    if not left_to_data(config):
        return config
    config = copy.deepcopy(config)
    for line in resolve(config):
        if say:
            say(line)
    return config


def builds_tokenizer(config, task: str) -> bool:
    """Whether the run builds its tokenizer as config.data describes it (not a token store's, an image
    run's palette, nor the one of config.init_from that a classifier fine-tunes with)."""
    if task in ("lm", "mlm"):
        return lm_streams.store_indexes(config.data.source) is None and not pixels.is_image_source(config.data.source)
    return not (task in TEXT_TOKENIZERS and config.init_from)


def image_side(typical: int, patch: int) -> int:
    """The side images of a typical (shorter) side `typical` are viewed at: the nearest multiple of `patch`
    (halves up), at least one patch, at most LARGEST_SIDE and MOST_PATCHES patches."""
    patch = max(patch, 1)
    most = min(LARGEST_SIDE, MOST_PATCHES * patch) // patch * patch
    return max(patch, min(most, patch * int(typical / patch + 0.5)))


def _take(config, taken: dict, key: str, value) -> bool:
    """Sets `key` to the data's `value` where config leaves it to the data (noted in `taken`); whether it did."""
    if config_lib.leaves(config)[key] != FROM_DATA[key]:
        return False
    section, name = key.split(".")
    config[section][name] = value
    taken[key] = value
    return True


def _said(says: list[str], taken: dict, how: str = "") -> list[str]:
    if not taken:
        return says
    return [*says, "from the data: " + ", ".join(f"{k}={v!r}" for k, v in taken.items()) + how]


def _images(config) -> list[str]:
    m, source = config.model, config.data.source
    holds = image_sources.describe(config.data)
    sides = sorted(min(side) for side in holds.sides)
    typical = int(np.median(sides))
    shape = (f"{holds.sides[0][0]} x {holds.sides[0][1]}" if len(set(holds.sides)) == 1
             else f"{sides[0]}..{sides[-1]} px on the shorter side (median {typical}) of {len(sides)} sampled")
    says = [f"data: {source}: {holds.classes:,} classes, {COLOUR.get(holds.channels, f'{holds.channels}-channel')} "
            f"{shape} images"]
    taken, how = {}, ""
    if not _take(config, taken, "model.num_classes", holds.classes):
        if m.num_classes < holds.classes:
            raise ValueError(f"config.model.num_classes={m.num_classes} but {source} holds {holds.classes} classes: "
                             "raise it, or leave it out (the data's)")
        if m.num_classes > holds.classes:
            says.append(f"config.model.num_classes={m.num_classes}: {source} holds {holds.classes}; the head's other "
                        f"{m.num_classes - holds.classes} outputs are never a target")
    if not _take(config, taken, "model.channels", holds.channels) and m.channels != holds.channels:
        if not holds.files or m.channels not in COLOUR:
            raise ValueError(f"config.model.channels={m.channels} but {source} holds {holds.channels}-channel images"
                             + (": files are read as 1 (grayscale) or 3 (RGB)" if holds.files else ""))
        says.append(f"config.model.channels={m.channels}: {source}'s images are {COLOUR[holds.channels]}, read as "
                    f"{COLOUR[m.channels]}")
    if _take(config, taken, "model.image_size", image_side(typical, m.patch_size)):
        how = (f" (image_size: the images' median side, {typical}, to the nearest multiple of patch_size="
               f"{m.patch_size}; at most {LARGEST_SIDE} and {MOST_PATCHES} patches a side)")
    elif not typical / 2 <= m.image_size <= 2 * typical:
        says.append(f"config.model.image_size={m.image_size}: {source}'s images are typically {typical} px a side, "
                    f"viewed at {m.image_size} x {m.image_size}")
    return _said(says, taken, how)


def _labels(config, task: str) -> tuple[str, str, int]:
    """Where a classifier's labelled text is, what it holds and its number of labels."""
    paths = classification.given_paths(config.data)
    if paths is None:
        name, count, what = EMBEDDED[task]
        return f"the embedded {name} task", f"{count} labels ({what})", count
    path = paths["train"]
    if task == "sequence_classification":
        examples = labelled.read_labelled(path)
        labels, held = [label for label, _ in examples], f"{len(examples):,} labelled texts"
    else:
        sentences = labelled.read_conll(path)
        labels = [tag for _, tags in sentences for tag in tags]
        held = f"{len(sentences):,} tagged sentences ({sum(len(words) for words, _ in sentences):,} words)"
    names = classification.names_for(config, labels, path)
    shown = ", ".join(names[:SHOWN_LABELS]) + (", ..." if len(names) > SHOWN_LABELS else "")
    order = "" if names == classification.names_of(labels) else ": the ids of config.init_from's head"
    return path, f"{held}, {len(names)} labels ({shown}{order})", len(names)


def _text(config, task: str) -> list[str]:
    d, m = config.data, config.model
    taken = {}
    if task in EMBEDDED:
        text, held, labels = _labels(config, task)
    else:
        text, held = d.source, "text"
    if builds_tokenizer(config, task):
        _take(config, taken, "data.tokenizer", TEXT_TOKENIZERS[task])
        kind = d.tokenizer
        ids = tokenizers.expected_size(d, m.vocab_size) or tokenizers.hf_tokenizer(d.tokenizer_path).vocab_size
        says = [f"data: {text}: {held}, tokenized by {kind} ({ids:,} ids"
                + (", trained on it)" if kind in ("bpe", "wordpiece") and not d.tokenizer_path else ")")]
    elif task in ("lm", "mlm"):
        indexes = lm_streams.store_indexes(d.source)
        kind, ids = indexes[0][1]["tokenizer"]["kind"], int(indexes[0][1]["vocab_size"])
        says = [f"data: {path}: a token store of {index['splits']['train']['tokens']:,} train tokens in "
                f"{index['splits']['train']['documents']:,} documents, tokenized by {index['tokenizer']['kind']} "
                f"({index['vocab_size']:,} ids)" for path, index in indexes]
    else:
        pretrained = rundir.open(config.init_from)
        kind, ids = pretrained.tokenizer().kind, int(pretrained.config.model.vocab_size)
        says = [f"data: {text}: {held}", f"data: {config.init_from}'s tokenizer ({kind}) and its model's {ids:,} ids"]
    if task in ("lm", "mlm") and "document_mask" in d:
        says[-1] += ("; documents masked: each token attends within its own document" if d.document_mask else
                     "; documents not masked: a row's documents attend to each other (config.data.document_mask)")
    _take(config, taken, "data.tokenizer", kind)
    if not _take(config, taken, "model.vocab_size", ids) and m.vocab_size > ids:
        says.append(f"config.model.vocab_size={m.vocab_size}: the {kind} tokenizer has {ids:,} ids; the embedding's "
                    f"other {m.vocab_size - ids:,} rows are never read")
    if task in EMBEDDED and not _take(config, taken, "model.num_labels", labels):
        if m.num_labels < labels:
            raise ValueError(f"config.model.num_labels={m.num_labels} but {text} holds {labels} labels: raise it, or "
                             "leave it out (the data's)")
        if m.num_labels > labels:
            says.append(f"config.model.num_labels={m.num_labels}: {text} holds {labels} labels; the head's other "
                        f"{m.num_labels - labels} outputs are never a target")
    return _said(says, taken)
