"""Where text documents come from: file lists, readers and the train/eval split.

The default source, `"stdlib"`, is the Python standard library's own `.py` files,
present on every machine with Python. Any other source is a glob of plain-text or
JSON-lines files. Documents are named relative to the common directory of their files,
so a document's name, and therefore its split, is the same on every machine.
"""

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator

STDLIB = "stdlib"
_SKIPPED_DIRS = ("site-packages", "dist-packages")
_JSON_LINES = (".jsonl", ".json")


def stdlib_files() -> list[str]:
    """Sorted paths of the standard library's `.py` files, installed packages left out."""
    paths = []
    for directory, subdirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
        paths.extend(os.path.join(directory, n) for n in names if n.endswith(".py"))
    return sorted(paths)


def resolve_files(source: str) -> list[str]:
    """Sorted files of `source`: `"stdlib"`, a glob (`**` and `~` allowed) or a path."""
    if source == STDLIB:
        return stdlib_files()
    pattern = os.path.expanduser(source)
    files = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not files:
        raise FileNotFoundError(
            f"no files match {source!r}: set config.data.source to a glob, a file or {STDLIB!r}")
    return files


def _root(files: list[str]) -> str:
    return os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])


def _json_lines(path: str, name: str, text_field: str) -> Iterator[tuple[str, str]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(
                    f"{path}:{lineno}: no field {text_field!r} (set config.data.text_field)")
            yield f"{name}:{lineno}", record[text_field]


def read_documents(files: list[str], text_field: str = "text") -> Iterator[tuple[str, str]]:
    """Yields (name, text) per document: one per JSON line, one per other file.

    Names are relative to the files' common directory (the stdlib root for `"stdlib"`).
    """
    if not files:
        return
    root = _root(files)
    for path in files:
        name = os.path.relpath(os.path.abspath(path), root)
        if path.endswith(_JSON_LINES):
            yield from _json_lines(path, name, text_field)
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield name, f.read()


def split_of(name: str, eval_fraction: float) -> str:
    """`"eval"` or `"train"` for a document, from a hash of its name stable across runs."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction else "train"
