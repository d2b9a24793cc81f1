"""Language-modelling batches: one token stream per split, windows cut from it.

Documents are split into train and eval by a hash of their name, tokenised, and
concatenated in order. A training batch is a pure function of (seed, step): the global
batch's window offsets are drawn from `np.random.default_rng([seed, step])` and each
process takes its own rows, so the global batch is the same for any process count and a
resumed run needs only its step. Eval batches are fixed, evenly spaced windows.

Shapes: B local batch, L seq_len; every batch is int32 [B, L + 1].
"""

import hashlib
import json
import os

import numpy as np
import tqdm

from transformer.data import sources

CACHE_DIR = "data_cache"


def storage_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id below `vocab_size`."""
    if vocab_size <= 256:
        return np.dtype(np.uint8)
    if vocab_size <= 65535:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def split_documents(data_config) -> dict[str, list[str]]:
    """The texts of each split, `"train"` and `"eval"`, in document order."""
    files = sources.resolve_files(data_config.source)
    splits = {"train": [], "eval": []}
    for name, text in sources.read_documents(files, data_config.text_field):
        splits[sources.split_of(name, data_config.eval_fraction)].append(text)
    if data_config.eval_fraction > 0 and not splits["eval"] and len(splits["train"]) >= 2:
        splits["eval"].append(splits["train"].pop())
    return splits


def _encode(texts: list[str], tokenizer, desc: str) -> tuple[np.ndarray, int]:
    """Concatenated ids of `texts` and their number of UTF-8 bytes."""
    dtype = storage_dtype(tokenizer.vocab_size)
    pieces = [tokenizer.encode(t).astype(dtype) for t in tqdm.tqdm(
        texts, desc=f"tokenizing {desc}", unit="doc", disable=None)]
    num_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype), num_bytes


def _cache_path(data_config, tokenizer, workdir: str) -> str:
    key = json.dumps([data_config.source, data_config.text_field, tokenizer.kind,
                      tokenizer.vocab_size, data_config.eval_fraction])
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
    return os.path.join(workdir, CACHE_DIR, f"{tokenizer.kind}-{digest}.npz")


def _tokenize(data_config, tokenizer) -> dict[str, np.ndarray]:
    splits = split_documents(data_config)
    train, _ = _encode(splits["train"], tokenizer, "train")
    eval_, eval_bytes = _encode(splits["eval"], tokenizer, "eval")
    return {"train": train, "eval": eval_, "eval_bytes": np.int64(eval_bytes)}


def load_tokens(data_config, tokenizer, workdir: str | None) -> dict[str, np.ndarray]:
    """`train` and `eval` token arrays and `eval_bytes`, cached under `workdir`.

    The byte tokenizer is not cached: reading the bytes is as fast as loading them.
    """
    if workdir is None or tokenizer.kind == "byte":
        return _tokenize(data_config, tokenizer)
    path = _cache_path(data_config, tokenizer, workdir)
    if os.path.isfile(path):
        with np.load(path) as cached:
            return dict(cached)
    tokens = _tokenize(data_config, tokenizer)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.tmp.npz"
    np.savez(partial, **tokens)
    os.replace(partial, path)
    return tokens


class LMData:
    """Token stream for language modelling, split into train/eval by document."""

    def __init__(self, data_config, tokenizer, workdir: str | None, *, seed: int,
                 process_index: int = 0, process_count: int = 1):
        if data_config.batch_size % process_count:
            raise ValueError(
                f"config.data.batch_size={data_config.batch_size} is not divisible by the "
                f"{process_count} processes")
        self.seed = seed
        self.seq_len = data_config.seq_len
        self.global_batch = data_config.batch_size
        self.local_batch = data_config.batch_size // process_count
        self._rows = slice(process_index * self.local_batch,
                           (process_index + 1) * self.local_batch)
        tokens = load_tokens(data_config, tokenizer, workdir)
        self.train_tokens = tokens["train"]
        self.eval_tokens = tokens["eval"]
        if len(self.train_tokens) < self.seq_len + 1:
            raise ValueError(
                f"the train split has {len(self.train_tokens)} tokens, fewer than "
                f"config.data.seq_len + 1 = {self.seq_len + 1}: use more data or a "
                "smaller seq_len")
        self.bytes_per_token = (float(tokens["eval_bytes"]) / len(self.eval_tokens)
                                if len(self.eval_tokens) else float("nan"))
        self._eval = self._eval_windows(data_config.eval_batches)

    def _windows(self, tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        return tokens[offsets[..., None] + np.arange(self.seq_len + 1)].astype(np.int32)

    def train_batch(self, step: int) -> np.ndarray:
        """This process's rows of the global batch for `step`: int32 [B, L + 1]."""
        rng = np.random.default_rng([self.seed, step])
        offsets = rng.integers(0, len(self.train_tokens) - self.seq_len, self.global_batch)
        return self._windows(self.train_tokens, offsets[self._rows])

    def _eval_windows(self, num_batches: int) -> list[np.ndarray]:
        if num_batches < 1:
            return []
        window = self.seq_len + 1
        num_batches = min(num_batches, len(self.eval_tokens) // window // self.global_batch)
        if num_batches < 1:
            raise ValueError(
                f"the eval split has {len(self.eval_tokens)} tokens, too few for one batch of "
                f"{self.global_batch} windows of {window}: raise config.data.eval_fraction or "
                "lower config.data.seq_len")
        count = num_batches * self.global_batch
        offsets = np.linspace(0, len(self.eval_tokens) - window, count).astype(np.int64)
        offsets = offsets.reshape(num_batches, self.global_batch)[:, self._rows]
        return list(self._windows(self.eval_tokens, offsets))

    def eval_batches(self) -> list[np.ndarray]:
        """The fixed eval batches, this process's rows of each: int32 [B, L + 1].

        As many as `config.data.eval_batches` asks for and the eval split holds; none if it
        asks for 0.
        """
        return self._eval
