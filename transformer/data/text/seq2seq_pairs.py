"""Sequence pairs: the TSV reader, the embedded code -> docstring task, and a side's ids padded to a batch.

A pairs file holds one `source<TAB>target` per line (blank lines are skipped). The
embedded default, code2doc, is built from the Python standard library with `ast`: for
every function with a docstring, the source is the function's code without its
docstring and the target is the docstring's first line.
"""

import ast
import hashlib
import os

import numpy as np

from transformer.data.text import sources, tokenizers

EVAL_FRACTION = 0.05
MAX_SOURCE_LINES = 12
MAX_SOURCE_CHARS = 400
MAX_TARGET_CHARS = 120
MAX_TRAIN = 20000
MAX_EVAL = 1000
_TEST_DIRS = {"test", "tests", "idle_test"}


def read_pairs(path: str) -> list[tuple[str, str]]:
    """(source, target) per non-blank line of a TSV file; a malformed line fails naming path:line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pairs file {path} not found (config.data.train_path / eval_path)")
    pairs = []
    for lineno, line in sources.numbered_lines(path):
        line = line.rstrip("\n").rstrip("\r")
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 2 or not fields[0].strip() or not fields[1].strip():
            raise ValueError(f"{path}:{lineno}: expected 'source<TAB>target' with both non-empty, "
                             f"found {len(fields)} tab-separated field(s)")
        pairs.append((fields[0], fields[1]))
    if not pairs:
        raise ValueError(f"{path}: no pairs (expected lines 'source<TAB>target')")
    return pairs


def one_line(code: str) -> str:
    """Code as one TSV-safe line: each line stripped of its indentation, lines joined by ' \\n '
    (a backslash and an n), tabs as spaces; cut to MAX_SOURCE_LINES lines and MAX_SOURCE_CHARS."""
    lines = [line.strip().replace("\t", " ") for line in code.splitlines()]
    return " \\n ".join(line for line in lines if line)[:MAX_SOURCE_CHARS]


def function_pairs(text: str) -> list[tuple[str, str]]:
    """(code without docstring, first docstring line) for every documented function in `text`."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines, pairs = text.splitlines(), []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        target = doc.strip().splitlines()[0].strip().replace("\t", " ") if doc and doc.strip() else ""
        if len(target.split()) < 2 or len(node.body) < 2:
            continue
        docstring = node.body[0]
        start = (node.decorator_list[0] if node.decorator_list else node).lineno
        kept = lines[start - 1: docstring.lineno - 1] + lines[docstring.end_lineno: node.end_lineno]
        pairs.append((one_line("\n".join(kept[:MAX_SOURCE_LINES])), target[:MAX_TARGET_CHARS]))
    return pairs


def _split_of(name: str) -> str:
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < EVAL_FRACTION else "train"


def _write(path: str, pairs: list[tuple[str, str]]) -> None:
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w", encoding="utf-8") as f:
        f.writelines(f"{source}\t{target}\n" for source, target in pairs)
    os.replace(partial, path)


def prepare_code2doc(out_dir: str) -> dict[str, str]:
    """Writes code2doc_{train,eval}.tsv into `out_dir` (split by a hash of the file name, capped
    at MAX_TRAIN / MAX_EVAL pairs, test suites left out); returns {split: path}."""
    files = sources.stdlib_files()
    root = os.path.commonpath([os.path.dirname(f) for f in files])
    splits = {"train": [], "eval": []}
    for path in files:
        name = os.path.relpath(path, root)
        if _TEST_DIRS & set(name.split(os.sep)[:-1]):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            splits[_split_of(name)].extend(function_pairs(f.read()))
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split, cap in (("train", MAX_TRAIN), ("eval", MAX_EVAL)):
        paths[split] = os.path.join(out_dir, f"code2doc_{split}.tsv")
        _write(paths[split], splits[split][:cap])
    return paths


def pad_batch(rows: list, length: int) -> np.ndarray:
    """Id sequences -> int32 [B, length], cut at `length` and padded with [PAD] = 0."""
    out = np.zeros((len(rows), length), np.int32)
    for r, ids in enumerate(rows):
        ids = np.asarray(ids, np.int32)[:length]
        out[r, : len(ids)] = ids
    return out


def source_ids(tokenizer, text: str, source_len: int, eos: bool = False) -> np.ndarray:
    """A source's ids [<= source_len], ending in [EOS] when `eos` (T5's convention: `</s>` appended)."""
    ids = tokenizer.encode(text)
    if not eos:
        return ids[:source_len]
    return np.r_[ids[:source_len - 1], tokenizers.require_special(tokenizer, "[EOS]")].astype(np.int32)
