"""The keymap tasks' data: one fixed random mapping of 8 letters onto 8 digits (keymap.jsonl beside this file),
64 queries `k` whose answer is the key's digit, each with its own `id`: lm-eval draws the few-shot examples from
the same split and drops every example equal to the query, so without the id every line of the query's key
would be dropped and no prompt could show the answer. The YAML files load it with `custom_dataset: !function
keymap.load`, so the folder works from any directory (`--include_path experiments/few_shot/tasks`).

  python experiments/few_shot/tasks/keymap.py    # writes keymap.jsonl again (seed 2026)
"""

import json
import os

import datasets
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
KEYS, VALUES = "abcdefgh", "01234567"


def load(**kwargs) -> datasets.DatasetDict:
    """The queries as lm-eval's dataset: one split, 'test' (few-shot examples are drawn from it too)."""
    return datasets.DatasetDict({"test": datasets.Dataset.from_json(os.path.join(HERE, "keymap.jsonl"))})


def write(seed: int = 2026, queries: int = 64) -> None:
    rng = np.random.default_rng(seed)
    mapping = dict(zip(KEYS, rng.permutation(list(VALUES))))
    with open(os.path.join(HERE, "keymap.jsonl"), "w") as f:
        for i, key in enumerate(rng.choice(list(KEYS), queries)):
            f.write(json.dumps({"id": i, "key": str(key), "value": str(mapping[key]),
                                "label": VALUES.index(mapping[key])}) + "\n")


if __name__ == "__main__":
    write()
