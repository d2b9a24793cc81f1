"""The shapes a run takes from its data: the config keys a config file leaves to the data, filled in once.

A config file leaves a key to the data by giving it its value in FROM_DATA (0, or '' for the
tokenizer); any other value, from the config's arg, a --config.KEY flag or Python, is the user's and
stays. `resolve` fills them in before the model is built (the command, once; config.json then holds the
real shape, which a resumed run, evaluate and predict read) and says what the data holds and what
the run took from it. A key the user set that the data contradicts is said in one line where the
run still works; where it cannot, the run fails in one line naming the key.

What a task takes from its data is the task's own: its module's `from_data(config)` (see
`transformer.training.tasks`) fills the keys in with `take` and says so with `said`; the text tasks share
`tasks/tokens.py` (a store's or a text source's tokenizer and ids), the classifiers `tasks/classification.py`
(num_labels from the train file, or the init_from head's), the image task its classes, channels and side.
"""

import copy

from transformer import config as config_lib
from transformer.training import tasks

FROM_DATA = {"data.tokenizer": "", "model.vocab_size": 0, "model.num_classes": 0, "model.channels": 0,
             "model.image_size": 0, "model.num_labels": 0}


def left_to_data(config) -> list[str]:
    """The keys of `config` that it leaves to the data."""
    values = config_lib.leaves(config)
    return [key for key, value in FROM_DATA.items() if key in values and values[key] == value]


def resolve(config) -> list[str]:
    """Fills in the keys `config` leaves to the data, in place (its task's `from_data`); returns the lines that
    say what the data holds, what was taken from it and where a key the user set disagrees with it."""
    return tasks.module(tasks.name_of(config)).from_data(config)


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


def take(config, taken: dict, key: str, value) -> bool:
    """Sets `key` to the data's `value` where config leaves it to the data (noted in `taken`); whether it did."""
    if config_lib.leaves(config)[key] != FROM_DATA[key]:
        return False
    section, name = key.split(".")
    config[section][name] = value
    taken[key] = value
    return True


def said(says: list[str], taken: dict, how: str = "") -> list[str]:
    """`says` and, where anything was `taken`, the line that names it."""
    if not taken:
        return says
    return [*says, "from the data: " + ", ".join(f"{k}={v!r}" for k, v in taken.items()) + how]
