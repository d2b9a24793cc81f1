"""Labelled-text and token-tagging data: the loaders of the user formats and the embedded defaults.

Formats (UTF-8):
  labelled text  `label<TAB>text` per line (blank lines skipped)
  CoNLL          `token<TAB>tag` per line, a blank line between sentences

Embedded default tasks, derived from the Python standard library (nothing to download),
written in those formats by `python -m transformer.data.prepare {package|tokentype} OUT_DIR`:
  package    which top-level stdlib package a function or method comes from
             (text = its first SOURCE_LINES lines with every run of whitespace collapsed to
             one space: the WordPiece pre-tokenizer ignores whitespace anyway)
  tokentype  the `tokenize` type (NAME, OP, NUMBER, STRING, COMMENT) of each token of a
             logical source line; layout tokens (NEWLINE, NL, INDENT, DEDENT, ...) are
             left out, and a token's tabs and newlines are written as the two characters
             `\\t` and `\\n` (long strings cut to MAX_TOKEN_CHARS)
Test files (`test`, `tests`, `idle_test` folders) are left out. The train/eval split is by
source file (`sources.split_of` of its stdlib-relative name), the same on every machine.
"""

import ast
import collections
import functools
import io
import os
import re
import sysconfig
import tokenize

import numpy as np

from transformer.data.text import sources

EVAL_FRACTION = 0.2
SOURCE_LINES = 12
NUM_PACKAGES = 16
MIN_EXAMPLES = {"train": 100, "eval": 20}
MAX_EXAMPLES = {"train": 250, "eval": 60}  # per package
TAGS = ("NAME", "OP", "NUMBER", "STRING", "COMMENT")
LINES_PER_FILE = 8
MAX_TOKEN_CHARS = 50
MAX_SENTENCE_TOKENS = 48
_TEST_DIRS = {"test", "tests", "idle_test"}


def _fields(path: str, lineno: int, line: str, what: str) -> tuple[str, str]:
    parts = line.rstrip("\r\n").split("\t")
    if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
        raise ValueError(f"{path}:{lineno}: expected {what} (two non-empty fields separated by one tab), "
                         f"got {line.strip()[:60]!r}")
    return parts[0].strip(), parts[1].strip()


IGNORE = -1  # a label left out of a classifier's loss and metrics (padding, a word's later sub-tokens)


def read_once(read):
    """`read(path)`, remembered for the file as it stands (its size and modification time): a launch reads a
    labelled file once, for the shapes it gives the model and again for its batches."""
    @functools.lru_cache(maxsize=4)
    def remembered(path: str, stamp: tuple) -> list:
        return read(path)

    @functools.wraps(read)
    def reader(path: str) -> list:
        stat = os.stat(os.path.expanduser(path))
        return remembered(path, (stat.st_size, stat.st_mtime_ns))
    return reader


@read_once
def read_labelled(path: str) -> list[tuple[str, str]]:
    """(label, text) per line of a `label<TAB>text` file; a malformed line fails naming path:line."""
    examples = []
    for lineno, line in sources.numbered_lines(path):
        if line.strip():
            examples.append(_fields(path, lineno, line, "label<TAB>text"))
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


@read_once
def read_conll(path: str) -> list[tuple[list[str], list[str]]]:
    """(tokens, tags) per sentence of a CoNLL `token<TAB>tag` file; a bad line fails naming path:line."""
    sentences, tokens, tags = [], [], []
    for lineno, line in sources.numbered_lines(path):
        if not line.strip():
            if tokens:
                sentences.append((tokens, tags))
            tokens, tags = [], []
            continue
        token, tag = _fields(path, lineno, line, "token<TAB>tag")
        tokens.append(token)
        tags.append(tag)
    if tokens:
        sentences.append((tokens, tags))
    if not sentences:
        raise ValueError(f"{path}: no sentences")
    return sentences


def _library_files() -> list[tuple[str, str]]:
    """(stdlib-relative name, path) of the non-test standard library files."""
    root = sysconfig.get_paths()["stdlib"]
    named = [(os.path.relpath(p, root), p) for p in sources.stdlib_files()]
    return [(name, p) for name, p in named if not _TEST_DIRS & set(name.split(os.sep))]


def _parse(path: str) -> tuple[str, ast.Module] | None:
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        return text, ast.parse(text)
    except SyntaxError:
        return None


def _functions(tree: ast.Module):
    """Top-level functions and the methods of top-level classes."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, kinds):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from (m for m in node.body if isinstance(m, kinds))


def _package_examples() -> dict[str, dict[str, list[str]]]:
    """split -> package -> function texts, in file order."""
    examples = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    for name, path in _library_files():
        parsed = _parse(path)
        if parsed is None:
            continue
        lines = parsed[0].splitlines()
        package = name.split(os.sep)[0].removesuffix(".py")
        split = sources.split_of(name, EVAL_FRACTION)
        for node in _functions(parsed[1]):
            source = " ".join(lines[node.lineno - 1: min(node.end_lineno, node.lineno - 1 + SOURCE_LINES)])
            examples[split][package].append(re.sub(r"\s+", " ", source).strip())
    return examples


def _write(path: str, lines: list[str]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(lines)
    return path


def _spread(items: list, count: int) -> list:
    """At most `count` items, evenly spaced over `items` (all of them if fewer)."""
    if len(items) <= count:
        return items
    return [items[i] for i in np.linspace(0, len(items) - 1, count).astype(int)]


def prepare_package(out_dir: str) -> dict[str, str]:
    """Writes package.{train,eval}.tsv (`package<TAB>function source`) into out_dir; returns their paths.

    The NUM_PACKAGES packages with the most functions among those with at least
    MIN_EXAMPLES in each split, at most MAX_EXAMPLES per package and split.
    """
    examples = _package_examples()
    eligible = [p for p in examples["train"]
                if all(len(examples[s][p]) >= MIN_EXAMPLES[s] for s in ("train", "eval"))]
    chosen = sorted(eligible, key=lambda p: (-len(examples["train"][p]), p))[:NUM_PACKAGES]
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split in ("train", "eval"):
        rows = [f"{p}\t{text}\n" for p in sorted(chosen)
                for text in _spread(examples[split][p], MAX_EXAMPLES[split])]
        paths[split] = _write(os.path.join(out_dir, f"package.{split}.tsv"), rows)
    return paths


def _escape(token: str) -> str:
    return token[:MAX_TOKEN_CHARS].replace("\r", "").replace("\t", "\\t").replace("\n", "\\n")


def _logical_lines(text: str) -> list[list[tuple[str, str]]]:
    """(token, tag) lists, one per logical source line with at least one tagged token."""
    lines, current = [], []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            tag = tokenize.tok_name[tok.type]
            if tag in TAGS and tok.string.strip():
                current.append((_escape(tok.string), tag))
            elif tok.type in (tokenize.NEWLINE, tokenize.NL) and current:
                lines.append(current[:MAX_SENTENCE_TOKENS])
                current = []
    except (tokenize.TokenError, SyntaxError):
        return lines
    return lines


def prepare_tokentype(out_dir: str) -> dict[str, str]:
    """Writes tokentype.{train,eval}.conll (`token<TAB>type`) into out_dir; returns their paths.

    LINES_PER_FILE logical lines, evenly spaced, from every library file.
    """
    rows = {"train": [], "eval": []}
    for name, path in _library_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            sentences = _spread(_logical_lines(f.read()), LINES_PER_FILE)
        for sentence in sentences:
            rows[sources.split_of(name, EVAL_FRACTION)].extend([f"{t}\t{tag}\n" for t, tag in sentence] + ["\n"])
    os.makedirs(out_dir, exist_ok=True)
    return {split: _write(os.path.join(out_dir, f"tokentype.{split}.conll"), lines)
            for split, lines in rows.items()}


def frame(pieces: list[list[int]], seq_len: int, cls: int, sep: int) -> tuple[np.ndarray, np.ndarray]:
    """[CLS] pieces... [SEP] cut to seq_len and [PAD](0)-filled: tokens int32 [N, L], valid [N, L]."""
    tokens = np.zeros((len(pieces), seq_len), np.int32)
    for row, ids in zip(tokens, pieces):
        ids = [cls, *ids[:seq_len - 2], sep]
        row[:len(ids)] = ids
    return tokens, tokens != 0


def align(word_pieces: list[list[int]], tags: list[int], seq_len: int, unk: int) -> tuple[list[int], list[int]]:
    """Sub-token ids of the words and their labels: the word's tag on its first sub-token, IGNORE after.

    Cut to seq_len - 2 sub-tokens (room for [CLS] and [SEP]); a word with no sub-token reads as [UNK].
    """
    ids, labels = [], []
    for pieces, tag in zip(word_pieces, tags):
        pieces = pieces or [unk]
        ids.extend(pieces)
        labels.extend([tag] + [IGNORE] * (len(pieces) - 1))
    return ids[:seq_len - 2], labels[:seq_len - 2]


def read_inputs(task: str, path: str) -> tuple[list, list[str]]:
    """(inputs, their targets: [] where the file has none) of a file of inputs for a text classifier: for
    `sequence_classification` texts one a line, or labelled `label<TAB>text` (.tsv); else sentences one a line
    (words at whitespace), or CoNLL `token<TAB>tag` (.conll, .tsv)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--input={path}: no such file or folder")
    if os.path.isdir(path):
        raise ValueError(f"--input={path} is a folder: give a text file (one input a line)")
    tabbed = path.endswith((".tsv", ".conll"))
    if task == "sequence_classification":
        if tabbed:
            examples = read_labelled(path)
            return [text for _, text in examples], [label for label, _ in examples]
        return input_lines(path), []
    if tabbed:
        sentences = read_conll(path)
        return [words for words, _ in sentences], [tags for _, tags in sentences]
    return [line.split() for line in input_lines(path)], []


def input_lines(path: str) -> list[str]:
    """The non-blank lines of a file of inputs, stripped; none fails in one line."""
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    if not lines:
        raise ValueError(f"--input={path}: no inputs (one a line)")
    return lines
