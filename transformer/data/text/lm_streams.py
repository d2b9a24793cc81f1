"""Token streams for the language-modelling tasks: a run's token stores, their windows, in an order
without replacement.

Glossary: B this process's rows of the batch (the run's `rows`), W a window's tokens,
N a source's windows.

`config.data.source` is a token store (a directory that `python -m transformer.data.tokenize`
wrote), several with weights (`STORE=0.8,STORE=0.2`), or text in any form that command reads
(`stdlib`, a glob, JSON lines, ...), which the run tokenizes once into the store WORKDIR/store (the
stdlib once per machine, kept in the user's cache and hard-linked into each run's store).
The shards are memory-mapped: a process's memory does not grow with the stores and nothing
reads them at start-up. `config.data.eval_source` is a store whose eval split is evaluated
where the train store has none.

A source's train split is cut into N windows of W tokens, `stride` apart (a language model's
W = L + 1 windows overlap by one token, so that each token is a target once an epoch).
Example g (step x batch + row) reads window `order.epochs(local, N, (seed, source))` of the
source `order.Mixture` gives it: a pure function of (seed, step, row), whatever the number of
processes. The run records its stores' fingerprints, its tokenizer's and the weights' schedule
in WORKDIR/data.json: resuming on other stores, or another tokenizer, is refused; new weights
take effect from the step the run resumes at. Eval windows are evenly spaced over each
source's eval split; where no source has an eval split of one eval batch and no
`config.data.eval_source` is given (a single text file, a corpus of few documents), the last
`config.data.eval_fraction` of each source's train tokens (one eval batch at least) is held out
for eval instead (`held_out`), and said.
"""

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig

import numpy as np

from transformer import console
from transformer.data.text import order, sources, store_build, tokenizers
from transformer.data.text import token_store as store

STORE_DIR = "store"  # the run's own store, tokenized from a text source
RECORD = "data.json"


def parse_source(text: str) -> list[tuple[str, float]]:
    """'A' -> [('A', 1.0)]; 'A=0.8,B=0.2' -> [('A', 0.8), ('B', 0.2)]."""
    parts = [p.strip() for p in text.split(",") if p.strip()] if "=" in text else [text]
    out = []
    for part in parts:
        path, _, weight = part.rpartition("=") if "=" in part else (part, "", "1")
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"config.data.source={text!r}: {weight!r} is not a weight (STORE=0.8,STORE=0.2)") from None
        if value <= 0:
            raise ValueError(f"config.data.source={text!r}: the weight of {path} must be positive")
        out.append((path, value))
    return out


def is_store(path: str) -> bool:
    return os.path.isfile(os.path.join(os.path.expanduser(path), store.INDEX))


def store_indexes(source: str) -> list[tuple[str, dict]] | None:
    """(path, index) of each token store that `config.data.source` names (read from the indexes alone);
    None where it names text (or anything but stores)."""
    paths = [path for path, _ in parse_source(source)]
    if not all(is_store(path) for path in paths):
        return None
    return [(path, store.read_json(os.path.join(os.path.expanduser(path), store.INDEX))) for path in paths]


def store_settings(data_config, model_vocab_size: int) -> dict:
    """The tokenize settings of the run's own store of a text source (as the command would make them)."""
    trained = data_config.tokenizer in ("bpe", "wordpiece") and not data_config.tokenizer_path
    path = data_config.tokenizer_path
    return {"source": data_config.source, "eval_source": None, "text_field": data_config.text_field,
            "tokenizer": data_config.tokenizer,
            "tokenizer_path": os.path.abspath(os.path.expanduser(path)) if path else None,
            "vocab_size": tokenizers.trained_size(data_config, model_vocab_size) if trained else None,
            "sample_mb": 64.0 if trained else None, "eval_fraction": data_config.eval_fraction, "shard_mb": 16.0}


def open_stores(config, workdir: str) -> list[tuple[str, store.Store, float]]:
    """(name, store, weight) of each source of config.data.source; a text source is tokenized into
    WORKDIR/store first (once: a later launch finds it whole)."""
    text = config.data.source
    if len(parse_source(text)) == 1 and not is_store(text):
        out = os.path.join(workdir, STORE_DIR)
        settings = store_settings(config.data, config.model.vocab_size)
        _check_own_store(out, settings)
        if text == sources.STDLIB and not os.path.exists(out):
            _link_kept_stdlib(settings, out)
        store_build.build(settings, out, os.cpu_count() or 1)
        return [(STORE_DIR, store.Store.open(out), 1.0)]
    opened = []
    for path, weight in parse_source(text):
        if not is_store(path):
            raise FileNotFoundError(f"config.data.source: {path} is not a token store (no {store.INDEX}); build "
                                    "it with python -m transformer.data.tokenize")
        opened.append((os.path.basename(os.path.normpath(path)), store.Store.open(path), weight))
    return opened


def _link_kept_stdlib(settings: dict, out: str) -> None:
    """Hard-links (copies, across file systems) the stdlib's store of `settings` into `out`, tokenizing it
    first into the user's cache where no launch on this machine has yet; its index comes last, so that an
    interrupted link is an unfinished store that build() completes."""
    key = json.dumps([settings, sys.version, sysconfig.get_paths()["stdlib"]], sort_keys=True)
    kept = console.user_cache("stores", "stdlib-" + hashlib.sha256(key.encode()).hexdigest()[:16])
    try:
        os.makedirs(os.path.dirname(kept), exist_ok=True)
        with open(f"{kept}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one tokenizer of the cache at a time, across processes
            store_build.build(settings, kept, os.cpu_count() or 1)
    except OSError:
        return  # a cache that cannot be written: the run tokenizes into its own store
    files = [os.path.relpath(os.path.join(d, name), kept) for d, _, names in os.walk(kept) for name in names]
    for name in sorted(files, key=lambda name: name == store.INDEX):
        os.makedirs(os.path.dirname(os.path.join(out, name)), exist_ok=True)
        try:
            os.link(os.path.join(kept, name), os.path.join(out, name))
        except OSError:
            shutil.copy2(os.path.join(kept, name), os.path.join(out, name))


def _check_own_store(out: str, settings: dict) -> None:
    """The run's store, once begun, holds its data keys' text: a key changed since fails naming it."""
    changed, built = _store_change(out, settings)
    if changed:
        raise ValueError(f"config.data.{changed}={settings[changed]!r} but the run's store {out} was tokenized with "
                         f"{built!r}: a new --workdir tokenizes the text again")


def _store_change(out: str, settings: dict) -> tuple[str | None, object]:
    """(the first setting that the store begun at `out` was made with otherwise, its value there), or
    (None, None)."""
    record = next((os.path.join(out, name) for name in (store.INDEX, store.BUILD)
                   if os.path.isfile(os.path.join(out, name))), None)
    built = store.read_json(record)["settings"] if record else settings
    changed = next((key for key, value in settings.items() if built.get(key) != value), None)
    return changed, built.get(changed) if changed else None


def drop_stale_store(config, workdir: str) -> None:
    """Removes the run's own store (said) where it was made with other settings than config.data gives: what a
    launch that saved no step (a failed first launch) left, so that a corrected command tokenizes again."""
    if "text_field" not in config.data or len(parse_source(config.data.source)) != 1 or is_store(config.data.source):
        return
    out = os.path.join(workdir, STORE_DIR)
    changed, built = _store_change(out, store_settings(config.data, config.model.vocab_size))
    if changed:
        print(f"data: {out} was tokenized with config.data.{changed}={built!r} by a launch that saved no step: "
              "tokenizing again", file=sys.stderr)
        shutil.rmtree(out)


def check_source(config) -> None:
    """Before any work: a mixture names stores only, and each store's tokenizer is the one
    config.data names and fits the model (read from the indexes alone)."""
    entries = parse_source(config.data.source)
    for path, _ in entries:
        if is_store(path):
            index = store.read_json(os.path.join(os.path.expanduser(path), store.INDEX))
            _check_tokenizer(index["tokenizer"]["kind"], index["vocab_size"], path, config)
        elif len(entries) > 1:
            raise FileNotFoundError(f"config.data.source: {path} is not a token store (no {store.INDEX}); build "
                                    "it with python -m transformer.data.tokenize")


def _check_tokenizer(kind: str, vocab_size: int, path: str, config) -> None:
    if kind != config.data.tokenizer:
        raise ValueError(f"config.data.tokenizer={config.data.tokenizer!r} but the store {path} was tokenized "
                         f"with {kind!r}: leave the key out (a store's tokenizer is taken from it) or set it to {kind}")
    tokenizers.check_fits(vocab_size, kind, config.model.vocab_size)


def check_stores(opened: list, config) -> None:
    """One tokenizer for all, the one config.data names, and it fits the model."""
    kinds = {s.index["tokenizer"]["kind"] for _, s, _ in opened}
    prints = {s.index["tokenizer"]["fingerprint"] for _, s, _ in opened}
    if len(prints) > 1:
        each = ", ".join(f"{name}: {s.index['tokenizer']['kind']} of {s.vocab_size} ids" for name, s, _ in opened)
        raise ValueError(f"config.data.source: the stores were tokenized with different tokenizers ({each}); "
                         "a mixture's stores share one")
    _check_tokenizer(next(iter(kinds)), opened[0][1].vocab_size, opened[0][1].path, config)


def weight_schedule(workdir: str, opened: list, start_step: int, is_main: bool) -> list:
    """[(first step, weights)]: the run's record in WORKDIR/data.json, checked against the stores and
    their tokenizer and extended with new weights from `start_step` (said once); written by the
    main process."""
    tokenizer_fingerprint = opened[0][1].index["tokenizer"]["fingerprint"]
    path = os.path.join(workdir, RECORD)
    stores = [{"name": name, "path": os.path.abspath(s.path), "fingerprint": s.fingerprint} for name, s, _ in opened]
    weights = [w for _, _, w in opened]
    if not os.path.isfile(path):
        record = {"stores": stores, "tokenizer": tokenizer_fingerprint, "schedule": [[0, weights]]}
    else:
        record = store.read_json(path)
        if [s["fingerprint"] for s in record["stores"]] != [s["fingerprint"] for s in stores]:
            raise ValueError(f"{workdir} was trained on other token stores "
                             f"({', '.join(s['path'] for s in record['stores'])}, recorded in {path}): "
                             "resume it on those, or use a new --workdir")
        if record["tokenizer"] != tokenizer_fingerprint:
            raise ValueError(f"the stores' tokenizer differs from the one {workdir} was trained with: "
                             "use a new --workdir")
        last_step, last = record["schedule"][-1]
        if not np.allclose(last, weights):
            record["schedule"] = [*[e for e in record["schedule"] if e[0] < start_step], [start_step, weights]]
            if is_main:
                print(f"data: weights {last} -> {weights} from step {start_step} (recorded in {path})", file=sys.stderr)
    if is_main:
        store.write_json(path, record)
    return [(int(step), list(w)) for step, w in record["schedule"]]


def layout(tokens: np.ndarray, end_of_document: int) -> tuple[np.ndarray, np.ndarray]:
    """Each position's document within its window (the end-of-document tokens before it) and its
    position in that document: tokens [B, W] -> segments, positions int32 [B, W]."""
    ends = tokens == end_of_document
    segments = np.concatenate([np.zeros_like(ends[:, :1], np.int32), np.cumsum(ends, 1, dtype=np.int32)[:, :-1]], 1)
    index = np.arange(tokens.shape[1])
    after_end = np.where(ends, index + 1, 0)  # a document starts after each end
    starts = np.maximum.accumulate(np.concatenate([np.zeros_like(after_end[:, :1]), after_end[:, :-1]], 1), axis=1)
    return segments, (index - starts).astype(np.int32)


class Span:
    """Tokens [start, stop) of a split, read as a split of their own (a train split less its held-out tail)."""

    def __init__(self, split, start: int, stop: int):
        self.split, self.start, self.stop, self.name = split, start, stop, split.name
        self.text_bytes = round(split.text_bytes * (stop - start) / max(len(split), 1))

    def __len__(self) -> int:
        return self.stop - self.start

    def read(self, start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"tokens [{start}, {stop}) are outside the {len(self)} of a span of {self.name}")
        return self.split.read(self.start + start, self.start + stop)


def held_out(opened: list, config, needed: int, is_main: bool) -> list[int]:
    """The tokens to hold out for eval at the end of each source's train split: none where a source has an
    eval split of at least `needed` tokens (one eval batch), config.data.eval_source is given, or
    config.data.eval_batches=0; else config.data.eval_fraction of them, at least `needed` (said). A source
    too small to give one eval batch and keep as many tokens to train on fails naming the remedies."""
    d = config.data
    splits = [s.split("eval") for _, s, _ in opened if "eval" in s.index["splits"]]
    if not d.eval_batches or d.get("eval_source") or any(len(split) >= needed for split in splits):
        return [0] * len(opened)
    tokens = []
    for name, s, _ in opened:
        size = len(s.split("train"))
        take = max(math.ceil(d.get("eval_fraction", 0.0) * size), needed)
        if take > size // 2:
            raise ValueError(f"{s.path} holds {size} train tokens and no eval split of one batch ({needed} tokens): "
                             "too few to hold one out and train on as many; use more data, lower "
                             "config.data.batch_size or config.data.seq_len, give config.data.eval_source, or set "
                             "config.data.eval_batches=0 (no eval)")
        tokens.append(take)
        if is_main:
            print(f"data: {name} has no eval split of one eval batch ({needed} tokens): evaluating on the last "
                  f"{take:,} of its {size:,} train tokens, held out from training", file=sys.stderr)
    return tokens


@dataclasses.dataclass
class Source:
    """One store's train windows (W tokens, `stride` apart) and its eval split; with `held_out` tokens, the
    train split is all but its last `held_out` tokens, which are `held` (eval data)."""

    name: str
    store: store.Store
    width: int
    stride: int
    held_out: int = 0

    def __post_init__(self):
        whole = self.store.split("train")
        self.train = Span(whole, 0, len(whole) - self.held_out) if self.held_out else whole
        self.held = Span(whole, len(whole) - self.held_out, len(whole)) if self.held_out else None
        self.windows = (len(self.train) - self.width) // self.stride + 1 if len(self.train) >= self.width else 0
        if self.windows < 1:
            raise ValueError(f"{self.store.path}: its train split has {len(self.train)} tokens, fewer than a window "
                             f"of {self.width}: use more data or a smaller config.data.seq_len")

    def read(self, windows: np.ndarray) -> np.ndarray:
        """Windows -> int32 [len(windows), W]."""
        return np.stack([self.train.read(int(w) * self.stride, int(w) * self.stride + self.width)
                         for w in windows]).astype(np.int32)


class Streams:
    """A run's sources, and the windows of each of its batches (this process's rows)."""

    def __init__(self, opened: list, schedule: list, width: int, stride: int, batch_size: int, seed: int,
                 rows: np.ndarray, held: list[int] | None = None):
        self.sources = [Source(name, s, width, stride, h) for (name, s, _), h in zip(opened, held or [0] * len(opened))]
        self.end_of_document = opened[0][1].end_of_document
        self.batch_size, self.seed, self.rows = batch_size, seed, np.asarray(rows, np.int64)
        self.mixture = order.Mixture(schedule, batch_size, seed) if len(self.sources) > 1 else None

    def assignment(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of each of this process's rows at `step`."""
        g = step * self.batch_size + self.rows
        source, local = self.mixture(g) if self.mixture else (np.zeros_like(g), g)
        windows = np.empty_like(local)
        for s in np.unique(source):
            at = source == s
            windows[at] = order.epochs(local[at], self.sources[s].windows, (self.seed, int(s)))
        return source, windows

    def windows(self, step: int) -> np.ndarray:
        """int32 [B, W]: this process's rows of step's batch."""
        source, windows = self.assignment(step)
        out = np.empty((len(self.rows), self.sources[0].width), np.int32)
        for s in np.unique(source):
            at = source == s
            out[at] = self.sources[s].read(windows[at])
        return out

    def eval_windows(self, split: store.Split, count: int) -> np.ndarray:
        """`count` evenly spaced windows of W tokens of an eval split: int32 [count, W]."""
        width = self.sources[0].width
        starts = np.linspace(0, len(split) - width, count).astype(np.int64)
        return np.stack([split.read(int(s), int(s) + width) for s in starts]).astype(np.int32)


def eval_splits(opened: list, config, streams: Streams) -> list[tuple[str, store.Split]]:
    """(name, eval split) of each source that has one, else of config.data.eval_source; where `streams` hold
    out the ends of their train splits (`held_out`), those."""
    if streams.sources[0].held is not None:
        return [(source.name, source.held) for source in streams.sources]
    found = [(name, s.split("eval")) for name, s, _ in opened if "eval" in s.index["splits"]
             and len(s.split("eval"))]
    if found or not config.data.get("eval_source"):
        return found
    path = config.data.eval_source
    if not is_store(path):
        raise FileNotFoundError(f"config.data.eval_source={path!r} is not a token store (no {store.INDEX})")
    extra = store.Store.open(path)
    if extra.index["tokenizer"]["fingerprint"] != opened[0][1].index["tokenizer"]["fingerprint"]:
        raise ValueError(f"config.data.eval_source={path!r} was tokenized with another tokenizer than the train store")
    return [(os.path.basename(os.path.normpath(path)), extra.split("eval" if "eval" in extra.index["splits"]
                                                                    else "train"))]


def run_tokenizer(opened: list, workdir: str):
    """The stores' tokenizer, saved into the workdir (generate and fine-tuning read it there); a
    workdir that holds another one is refused."""
    tokenizer = opened[0][1].tokenizer()
    if not os.path.isfile(os.path.join(workdir, tokenizers.CONFIG_FILE)):
        tokenizer.save(workdir)
    elif tokenizers.identity(tokenizers.load_tokenizer(workdir)) != tokenizers.identity(tokenizer):
        raise ValueError(f"{workdir} holds a tokenizer other than its token store's ({opened[0][1].path}): its "
                         "checkpoints would read other ids; start a new --workdir")
    return tokenizer
