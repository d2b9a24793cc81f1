"""Build the embedded default task files from the Python standard library (no download).

  python -m transformer.data.prepare TASK OUT_DIR

TASK is one of PREPARERS: the files are written in the same user-facing formats the
loaders read (TSV, CoNLL), split deterministically into train and eval, so a user's own
files in those formats train the same way.
"""

import importlib

from transformer import cli

# task -> "module:function"; each function(out_dir) writes the files and returns {split: path}.
PREPARERS = {
    "package": "transformer.data.text.labelled:prepare_package",        # label<TAB>text: stdlib package of a function
    "tokentype": "transformer.data.text.labelled:prepare_tokentype",    # CoNLL: tokenize's type of each token
    "code2doc": "transformer.data.text.seq2seq_pairs:prepare_code2doc",  # source<TAB>target: code -> docstring line
}


def prepare(task: str, out_dir: str) -> dict[str, str]:
    if task not in PREPARERS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(PREPARERS)}")
    module, function = PREPARERS[task].split(":")
    return getattr(importlib.import_module(module), function)(out_dir)


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise ValueError(f"usage: python -m transformer.data.prepare {{{'|'.join(PREPARERS)}}} OUT_DIR")
    for split, path in prepare(argv[1], argv[2]).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    cli.run(main, positional=2)
