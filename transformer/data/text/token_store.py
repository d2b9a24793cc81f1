"""Token stores: a corpus tokenized once into shards of flat token ids and an index, read by np.memmap.

A store is a directory (built by `python -m transformer.data.tokenize`):

  index.json          the index, written last and atomically: a directory without it is not
                      a complete store and never opens as one (`Store.open` says so)
  tokenizer/          the tokenizer's files (`tokenizers.load_tokenizer` reads them); their
                      fingerprint is in the index
  train/NNNNNN.bin    chunk NNNNNN's train tokens: raw ids (no header) in the index's `dtype`,
  eval/NNNNNN.bin     each document followed by the index's `end_of_document` id
  build.json          the build's settings and plan, chunks/NNNNNN.json one per finished chunk
                      (what a resumed build skips); kept for the record

The corpus is cut into chunks of documents by a rule that depends on the files alone (never
on the number of workers), each chunk is tokenized alone and its shards are renamed into place
when whole, so the shards' bytes are the same for any number of workers and an interrupted
build resumes at the chunks it had not finished.

Index keys: `format`, `version`, `dtype`, `vocab_size`, `end_of_document`, `tokenizer` (kind,
directory, fingerprint, trained_on), `settings` (the build's options), `split_rule`, `chunks`,
`splits` ({name: {tokens, documents, text_bytes, shards: [{file, chunk, tokens, documents,
text_bytes, documents_holding_end_id, offset, sha256}]}}, offsets in tokens, int64; the documents
whose own text encodes to the end-of-document id, e.g. a literal "[EOS]" for a trained BPE, are
counted: 0 means the end-of-document ids are exactly the document ends) and `fingerprint`: a hash of the
dtype, end-of-document id, tokenizer fingerprint and every shard's sha256, computed while
writing and never again.

Reading (the API a trainer uses):

  store = Store.open(path)              # .index, .fingerprint, .dtype, .end_of_document
  train = store.split("train")          # len(train) tokens; train.num_documents
  train.read(start, stop)               # ids [start, stop) across shard boundaries (int64 offsets)
  train.shards, train.offsets           # the np.memmap of each shard, and where each starts
  store.tokenizer()                     # the stored tokenizer
"""

import errno
import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable

import numpy as np

from transformer.data.text import tokenizers

FORMAT = "transformer.token_store"
VERSION = 1
INDEX = "index.json"
BUILD = "build.json"
TOKENIZER_DIR = "tokenizer"
CHUNKS_DIR = "chunks"
SPLITS = ("train", "eval")
TMP = ".tmp"


def storage_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id below `vocab_size`."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"a vocabulary of {vocab_size} ids does not fit 32 bits")


def write_json(path: str, value) -> None:
    """Writes `value` as JSON to a temporary name, syncs it and renames it to `path` (atomic)."""
    partial = f"{path}.{os.getpid()}{TMP}"
    try:
        with open(partial, "w") as f:
            json.dump(value, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if os.path.exists(partial):
            os.remove(partial)
        raise no_space(path) if e.errno == errno.ENOSPC else e from None
    os.replace(partial, path)


def no_space(path: str) -> OSError:
    """The one-line error of a full disk while writing `path`: the path and the space there."""
    usage = shutil.disk_usage(os.path.dirname(path) or ".")
    return OSError(errno.ENOSPC, f"No space left on device ({usage.free / 1e9:.2f} GB free of {usage.total / 1e9:.1f} "
                   "GB; the partial shards are removed): free space there, or write the store to another disk", path)


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_fingerprint(directory: str) -> str:
    """sha256 over the names and contents of a tokenizer directory's files."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        digest.update(f"{name}\0{file_sha256(os.path.join(directory, name))}\0".encode())
    return "sha256:" + digest.hexdigest()


def shard_name(split: str, chunk: int) -> str:
    return f"{split}/{chunk:06d}.bin"


def chunk_path(out: str, chunk: int) -> str:
    return os.path.join(out, CHUNKS_DIR, f"{chunk:06d}.json")


def chunk_meta(out: str, chunk: int) -> dict | None:
    """What a finished chunk wrote (None while it is not finished)."""
    path = chunk_path(out, chunk)
    return read_json(path) if os.path.isfile(path) else None


class _ShardWriter:
    """One split's tokens of one chunk, appended to a temporary file and hashed as they go."""

    def __init__(self, out: str, split: str, chunk: int):
        self.path = os.path.join(out, shard_name(split, chunk))
        self.partial = f"{self.path}.{os.getpid()}{TMP}"
        self.file = None
        self.digest = hashlib.sha256()
        self.tokens = self.documents = self.text_bytes = self.end_inside = 0

    def write(self, ids: np.ndarray, documents: int, text_bytes: int, end_inside: int) -> None:
        if self.file is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.file = open(self.partial, "wb")
        data = ids.tobytes()
        try:
            self.file.write(data)
        except OSError as e:  # named: the file's own error says no path
            raise OSError(e.errno, e.strerror, self.path) from None
        self.digest.update(data)
        self.tokens += len(ids)
        self.documents += documents
        self.text_bytes += text_bytes
        self.end_inside += end_inside

    def discard(self) -> None:
        """Closes and removes the temporary file (a chunk that failed)."""
        if self.file is not None:
            self.file.close()
            self.file = None
        if os.path.exists(self.partial):
            os.remove(self.partial)

    def close(self) -> dict:
        """Syncs and renames the shard into place (none for a split without documents here)."""
        if self.file is not None:
            try:
                self.file.flush()
                os.fsync(self.file.fileno())
            except OSError as e:
                raise OSError(e.errno, e.strerror, self.path) from None
            self.file.close()
            os.replace(self.partial, self.path)
        return {"tokens": self.tokens, "documents": self.documents, "text_bytes": self.text_bytes,
                "documents_holding_end_id": self.end_inside, "sha256": self.digest.hexdigest() if self.tokens else None}


def write_chunk(out: str, chunk: int, documents: Iterable[tuple[str, str]],
                encode: Callable[[list[str]], list], end_of_document: int, dtype: np.dtype,
                batch_bytes: int = 1 << 20) -> dict:
    """Tokenizes a chunk's (split, text) documents in batches of about `batch_bytes` of text, writes
    its shards (memory: one batch), then its chunks/NNNNNN.json, which marks it finished."""
    cpu_start = time.process_time()
    writers = {split: _ShardWriter(out, split, chunk) for split in SPLITS}
    pending = {split: [] for split in SPLITS}
    sizes = dict.fromkeys(SPLITS, 0)
    end = np.array([end_of_document], dtype)

    def flush(split: str) -> None:
        texts = pending[split]
        pieces, inside = [], 0
        for ids in encode(texts):
            ids = np.asarray(ids, dtype=dtype)
            inside += bool((ids == end_of_document).any())  # a text holding the end-of-text token itself
            pieces += [ids, end]
        writers[split].write(np.concatenate(pieces), len(texts), sizes[split], inside)
        pending[split], sizes[split] = [], 0

    try:
        for split, text in documents:
            pending[split].append(text)
            sizes[split] += len(text.encode("utf-8"))
            if sizes[split] >= batch_bytes:
                flush(split)
        for split in SPLITS:
            if pending[split]:
                flush(split)
        splits = {split: writer.close() for split, writer in writers.items()}
    except OSError as e:  # a full disk, say: no partial shard is left behind
        for writer in writers.values():
            writer.discard()
        if e.errno == errno.ENOSPC:
            raise no_space(e.filename or os.path.join(out, CHUNKS_DIR)) from None
        raise
    meta = {"chunk": chunk, "splits": splits, "cpu_seconds": round(time.process_time() - cpu_start, 3)}
    os.makedirs(os.path.join(out, CHUNKS_DIR), exist_ok=True)
    write_json(chunk_path(out, chunk), meta)
    return meta


def content_fingerprint(dtype: str, end_of_document: int, tokenizer_fp: str, splits: dict) -> str:
    digest = hashlib.sha256(json.dumps([dtype, end_of_document, tokenizer_fp]).encode())
    for name in SPLITS:
        for shard in splits[name]["shards"]:
            digest.update(f"{name}\0{shard['sha256']}\0".encode())
    return "sha256:" + digest.hexdigest()


def finish(out: str, header: dict, metas: list[dict]) -> dict:
    """Writes the index from the chunks' records (in chunk order), last and atomically; returns it."""
    splits = {}
    for name in SPLITS:
        shards, offset = [], 0
        for meta in metas:
            part = meta["splits"][name]
            if part["tokens"]:
                shards.append({"file": shard_name(name, meta["chunk"]), "chunk": meta["chunk"], **part,
                               "offset": offset})
                offset += part["tokens"]
        splits[name] = {"tokens": offset, **{key: sum(s[key] for s in shards) for key in (
            "documents", "text_bytes", "documents_holding_end_id")}, "shards": shards}
    index = {"format": FORMAT, "version": VERSION, **header, "chunks": len(metas), "splits": splits}
    index["fingerprint"] = content_fingerprint(index["dtype"], index["end_of_document"],
                                               index["tokenizer"]["fingerprint"], splits)
    write_json(os.path.join(out, INDEX), index)
    return index


class Split:
    """One split of a store: its shards (as read-only memmaps, for whole-shard work), read as one
    stream of ids.

    `read` takes its ids with `os.pread`, not through the memmaps: a memory map keeps mapped every
    page a read faulted in, and with them the readahead around it (about 340 KB per random window
    on this machine's kernel), so a trainer's resident memory would grow towards the store's size
    as it reads. pread leaves those pages in the page cache, shared and reclaimable, outside the
    process; each read opens and closes its shard files, so no store has too many shards to read.
    """

    def __init__(self, root: str, name: str, entry: dict, dtype: np.dtype):
        self.root, self.name, self.dtype = root, name, dtype
        self.entries = entry["shards"]
        self.num_tokens = int(entry["tokens"])
        self.num_documents = int(entry["documents"])
        self.text_bytes = int(entry["text_bytes"])
        # where each shard starts in the split's stream, and its end: int64 [num_shards + 1]
        self.offsets = np.cumsum([0] + [s["tokens"] for s in self.entries], dtype=np.int64)

    def __len__(self) -> int:
        return self.num_tokens

    @functools.cached_property
    def shards(self) -> list[np.memmap]:
        return [np.memmap(os.path.join(self.root, s["file"]), dtype=self.dtype, mode="r", shape=(s["tokens"],))
                for s in self.entries]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Ids [start, stop) of the split (in its dtype), across shard boundaries."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) are outside the {self.name} split's {self.num_tokens}")
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        parts = [np.zeros(0, self.dtype)]
        size = self.dtype.itemsize
        while start < stop:
            begin = start - int(self.offsets[first])
            end = min(stop, int(self.offsets[first + 1])) - int(self.offsets[first])
            fd = os.open(os.path.join(self.root, self.entries[first]["file"]), os.O_RDONLY)
            try:
                data = os.pread(fd, (end - begin) * size, begin * size)
            finally:
                os.close(fd)
            parts.append(np.frombuffer(data, self.dtype))
            start += end - begin
            first += 1
        return np.concatenate(parts)  # a copy, writable


class Store:
    """A complete token store, opened from its index (see the module docstring)."""

    def __init__(self, path: str, index: dict):
        self.path, self.index = path, index
        self.dtype = np.dtype(index["dtype"])
        self.end_of_document = int(index["end_of_document"])
        self.vocab_size = int(index["vocab_size"])
        self.fingerprint = index["fingerprint"]

    @classmethod
    def open(cls, path: str) -> "Store":
        """The store at `path`; FileNotFoundError for an unfinished build or a damaged store."""
        path = os.path.expanduser(path)
        index_path = os.path.join(path, INDEX)
        if not os.path.isfile(index_path):
            if os.path.isfile(os.path.join(path, BUILD)):
                raise FileNotFoundError(f"{path} is an unfinished token store build (no {INDEX}): run the "
                                        "same tokenize command again to finish it")
            raise FileNotFoundError(f"{path} is not a token store (no {INDEX}): build one with "
                                    "python -m transformer.data.tokenize")
        index = read_json(index_path)
        if index.get("format") != FORMAT or index.get("version") != VERSION:
            raise ValueError(f"{index_path} is not a version-{VERSION} token store index")
        itemsize = np.dtype(index["dtype"]).itemsize
        for split in index["splits"].values():
            for shard in split["shards"]:
                file = os.path.join(path, shard["file"])
                size = os.path.getsize(file) if os.path.isfile(file) else None
                if size != shard["tokens"] * itemsize:
                    raise FileNotFoundError(f"{file} is {'missing' if size is None else f'{size} bytes'}, the index "
                                            f"says {shard['tokens'] * itemsize}: the store is damaged, rebuild it")
        return cls(path, index)

    def split(self, name: str) -> Split:
        if name not in self.index["splits"]:
            raise KeyError(f"no split {name!r} in {self.path} (splits: {', '.join(self.index['splits'])})")
        return Split(self.path, name, self.index["splits"][name], self.dtype)

    def tokenizer(self) -> tokenizers.Tokenizer:
        return tokenizers.load_tokenizer(os.path.join(self.path, self.index["tokenizer"]["directory"]))

    def documents(self, split: str, count: int, block: int = 1 << 16) -> list[np.ndarray]:
        """The first `count` documents of a split (their ids, without the end-of-document id)."""
        data, docs, start = self.split(split), [], 0
        while len(docs) < count and start < len(data):
            tokens = data.read(start, min(len(data), start + block))
            ends = np.flatnonzero(tokens == self.end_of_document)
            if not len(ends) and start + len(tokens) < len(data):
                block *= 2
                continue
            begin = 0
            for end in ends[:count - len(docs)]:
                docs.append(tokens[begin:end])
                begin = end + 1
            start += begin if len(ends) else len(tokens)
        return docs
