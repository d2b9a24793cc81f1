"""Where text documents come from: file lists, readers and the train/eval split.

The default source, `"stdlib"`, is the Python standard library's own `.py` files,
present on every machine with Python. Any other source is a glob (or a path) of files,
each read by its suffix, or a Hugging Face `datasets` directory written by
`save_to_disk` (its Arrow files, read with pyarrow: no `datasets`, no network):

  text        one document per file (any suffix not below)
  .jsonl .json            one document per line, its `text_field`; also gzip'd
  .jsonl.gz .jsonl.zst    (`.gz`) or zstandard (`.zst`) compressed
  .parquet    one document per row, its `text_field` column
  .arrow      the same, an Arrow IPC stream (a `datasets` directory's files)

Documents are named relative to the common directory of their files (`doc.txt`,
`data.jsonl:LINE`, `part.parquet:ROW`), so a document's name, and therefore its split,
is the same on every machine. Input that cannot be read fails with one line naming the
file and the line or row.

A file can be read in `Segment`s (byte ranges of a JSON-lines file cut at line starts,
row-group ranges of a Parquet file, whole files otherwise), so that workers read the
parts of a large corpus independently; `segments_of` cuts them.
"""

import dataclasses
import glob
import gzip
import hashlib
import json
import os
import sysconfig
import zlib
from collections.abc import Iterator

STDLIB = "stdlib"
HF_STATE = "state.json"  # marks a `datasets.save_to_disk` directory
_SKIPPED_DIRS = ("site-packages", "dist-packages")
_SUFFIXES = ((".jsonl.gz", "jsonl.gz"), (".json.gz", "jsonl.gz"), (".jsonl.zst", "jsonl.zst"),
             (".json.zst", "jsonl.zst"), (".jsonl", "jsonl"), (".json", "jsonl"),
             (".parquet", "parquet"), (".arrow", "arrow"))
_BATCH_ROWS = 1024


def stdlib_files() -> list[str]:
    """Sorted paths of the standard library's `.py` files, installed packages left out."""
    paths = []
    for directory, subdirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
        paths.extend(os.path.join(directory, n) for n in names if n.endswith(".py"))
    return sorted(paths)


def hf_dataset_files(directory: str) -> list[str]:
    """The Arrow files of a `datasets.save_to_disk` directory, in the order its state.json lists them."""
    path = os.path.join(directory, HF_STATE)
    with open(path) as f:
        try:
            state = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: malformed JSON ({e.msg})") from None
    entries = state.get("_data_files") if isinstance(state, dict) else None
    names = [e.get("filename") if isinstance(e, dict) else None for e in entries or []]
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{path} lists no data files: not a datasets directory?")
    return [os.path.join(directory, n) for n in names]


def resolve_files(source: str) -> list[str]:
    """Sorted files of `source`: `"stdlib"`, a `datasets` directory, a glob (`**` and `~` allowed) or a path."""
    if source == STDLIB:
        return stdlib_files()
    pattern = os.path.expanduser(source)
    if os.path.isfile(os.path.join(pattern, HF_STATE)):
        return hf_dataset_files(pattern)
    files = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not files:
        raise FileNotFoundError(
            f"no files match {source!r}: set config.data.source to a glob, a file or {STDLIB!r}")
    return files


def format_of(path: str) -> str:
    """How a file is read: 'text', 'jsonl', 'jsonl.gz', 'jsonl.zst', 'parquet' or 'arrow' (by suffix)."""
    lower = path.lower()
    return next((fmt for suffix, fmt in _SUFFIXES if lower.endswith(suffix)), "text")


def _root(files: list[str]) -> str:
    return os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])


@dataclasses.dataclass(frozen=True)
class Segment:
    """A part of one file that a worker reads alone.

    `start`/`stop`: a byte range for 'jsonl' (cut at line starts), a range of row groups for
    'parquet'; stop -1 means to the end. `first`: the line number (from 1) or row (from 0) at start.
    `size`: its bytes on disk, to cut the corpus into chunks.
    """

    path: str
    name: str
    start: int = 0
    stop: int = -1
    first: int = 0
    size: int = 0


def segments_of(files: list[str], text_field: str = "text", piece_bytes: int = 0) -> list[Segment]:
    """The files as segments: whole files, or with `piece_bytes` > 0 large JSON-lines and Parquet
    files cut into pieces of about that many bytes. Checks each Parquet or Arrow file's text column."""
    if not files:
        return []
    root = _root(files)
    segments = []
    for path in files:
        name = os.path.relpath(os.path.abspath(path), root)
        fmt = format_of(path)
        size = os.path.getsize(path)
        if fmt == "jsonl" and piece_bytes > 0:
            segments.extend(_jsonl_pieces(path, name, size, piece_bytes))
        elif fmt == "parquet":
            segments.extend(_parquet_pieces(path, name, text_field, piece_bytes))
        else:
            if fmt == "arrow":
                _arrow_reader(path, text_field).close()
            segments.append(Segment(path, name, first=1 if fmt.startswith("jsonl") else 0, size=size))
    return segments


def _jsonl_pieces(path: str, name: str, size: int, piece_bytes: int) -> Iterator[Segment]:
    """Byte ranges of about `piece_bytes`, each ending after a newline, with their first line numbers."""
    start, line = 0, 1
    with open(path, "rb") as f:
        while start < size:
            stop = min(start + piece_bytes, size)
            if stop < size:
                f.seek(stop - 1)
                f.readline()  # to the end of the line holding byte stop - 1
                stop = f.tell()
            yield Segment(path, name, start, stop, line, stop - start)
            f.seek(start)
            remaining = stop - start
            while remaining:
                block = f.read(min(remaining, 1 << 24))
                line += block.count(b"\n")
                remaining -= len(block)
            start = stop


def _parquet_file(path: str, text_field: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({_first_line(e)})") from None
    _check_column(path, parquet.schema_arrow, text_field)
    return parquet


def _check_column(path: str, schema, text_field: str) -> None:
    import pyarrow as pa

    if text_field not in schema.names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)}); "
                         "set config.data.text_field / --text_field")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"{path}: column {text_field!r} holds {kind}, not text")


def _parquet_pieces(path: str, name: str, text_field: str, piece_bytes: int) -> Iterator[Segment]:
    meta = _parquet_file(path, text_field).metadata
    groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
    start, row, size = 0, 0, 0
    for i, group in enumerate(groups):
        size += group.total_byte_size
        if piece_bytes > 0 and size >= piece_bytes or i == len(groups) - 1:
            yield Segment(path, name, start, i + 1, row, size)
            row += sum(g.num_rows for g in groups[start:i + 1])
            start, size = i + 1, 0
    if not groups:
        yield Segment(path, name, 0, 0, 0, 0)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _json_text(raw: bytes, path: str, lineno: int, text_field: str) -> str | None:
    """The text of one JSON line; None for a blank line."""
    line = raw.decode("utf-8", errors="replace")
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise ValueError(f"{path}:{lineno}: no field {text_field!r} (set config.data.text_field / --text_field)")
    return record[text_field]


def _json_lines(segment: Segment, text_field: str) -> Iterator[tuple[str, str]]:
    with open(segment.path, "rb") as f:
        f.seek(segment.start)
        position, lineno = segment.start, segment.first
        for raw in f:
            if 0 <= segment.stop <= position:
                break
            position += len(raw)
            text = _json_text(raw, segment.path, lineno, text_field)
            if text is not None:
                yield f"{segment.name}:{lineno}", text
            lineno += 1


def _zstd_lines(f) -> Iterator[bytes]:
    """The lines of a zstandard stream (frames one after another); EOFError where it is cut short
    (the library's stream reader ends quietly there)."""
    import zstandard

    decompressor, pending = zstandard.ZstdDecompressor().decompressobj(), b""
    while block := f.read(1 << 20):
        data = decompressor.decompress(block)
        while decompressor.eof and decompressor.unused_data:
            rest = decompressor.unused_data
            decompressor = zstandard.ZstdDecompressor().decompressobj()
            data += decompressor.decompress(rest)
        lines = (pending + data).split(b"\n")
        pending = lines.pop()
        yield from (line + b"\n" for line in lines)
    if not decompressor.eof:
        raise EOFError("the stream ends before its end-of-frame marker")
    if pending:
        yield pending


def _compressed_lines(segment: Segment, text_field: str) -> Iterator[tuple[str, str]]:
    """A gzip or zstandard JSON-lines file, streamed; a truncated or corrupt one names its line."""
    kind = "gzip" if segment.path.lower().endswith(".gz") else "zstandard"
    errors: tuple = (EOFError, OSError, zlib.error)
    if kind == "zstandard":
        import zstandard

        errors += (zstandard.ZstdError,)
    lineno = segment.first
    try:
        with open(segment.path, "rb") as f:
            for raw in gzip.GzipFile(fileobj=f) if kind == "gzip" else _zstd_lines(f):
                text = _json_text(raw, segment.path, lineno, text_field)
                if text is not None:
                    yield f"{segment.name}:{lineno}", text
                lineno += 1
    except errors as e:
        raise ValueError(f"{segment.path}:{lineno}: truncated or corrupt {kind} file ({_first_line(e)})") from None


def _rows(path: str, name: str, first: int, text_field: str, batches) -> Iterator[tuple[str, str]]:
    row = first
    for batch in batches:
        for text in batch.column(text_field).to_pylist():
            if text is None:
                raise ValueError(f"{path}: row {row}: {text_field!r} is null")
            yield f"{name}:{row}", text
            row += 1


def _arrow_reader(path: str, text_field: str):
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(pa.memory_map(path))
    except (pa.ArrowException, OSError):
        try:
            reader = pa.ipc.open_file(pa.memory_map(path))
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: not a readable Arrow file ({_first_line(e)})") from None
    _check_column(path, reader.schema, text_field)
    return reader


def _arrow_batches(reader):
    if hasattr(reader, "num_record_batches"):  # the random-access file format
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return reader


def read_segment(segment: Segment, text_field: str = "text") -> Iterator[tuple[str, str]]:
    """Yields (name, text) for each document of `segment`."""
    fmt = format_of(segment.path)
    if fmt == "text":
        with open(segment.path, encoding="utf-8", errors="replace") as f:
            yield segment.name, f.read()
    elif fmt == "jsonl":
        yield from _json_lines(segment, text_field)
    elif fmt in ("jsonl.gz", "jsonl.zst"):
        yield from _compressed_lines(segment, text_field)
    elif fmt == "parquet":
        import pyarrow as pa

        parquet = _parquet_file(segment.path, text_field)
        stop = parquet.metadata.num_row_groups if segment.stop < 0 else segment.stop
        if stop > segment.start:
            batches = parquet.iter_batches(_BATCH_ROWS, row_groups=range(segment.start, stop), columns=[text_field])
            try:
                yield from _rows(segment.path, segment.name, segment.first, text_field, batches)
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"{segment.path}: unreadable row group ({_first_line(e)})") from None
    else:
        import pyarrow as pa

        reader = _arrow_reader(segment.path, text_field)
        try:
            yield from _rows(segment.path, segment.name, segment.first, text_field, _arrow_batches(reader))
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{segment.path}: unreadable record batch ({_first_line(e)})") from None


def read_documents(files: list[str], text_field: str = "text") -> Iterator[tuple[str, str]]:
    """Yields (name, text) per document: one per JSON line or table row, one per other file.

    Names are relative to the files' common directory (the stdlib root for `"stdlib"`).
    """
    for segment in segments_of(files, text_field):
        yield from read_segment(segment, text_field)


def numbered_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number from 1, line) of a UTF-8 text file (a TSV); a byte that is not UTF-8 fails naming the file,
    line and column."""
    with open(os.path.expanduser(path), "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}): "
                                 "save the file as UTF-8") from None


def split_of(name: str, eval_fraction: float) -> str:
    """`"eval"` or `"train"` for a document, from a hash of its name stable across runs."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction else "train"
