"""Batches of images made by worker processes: step-indexed, per host, uint8.

Glossary of shapes: B the global batch, b this process's rows of it, S the image size, C channels.

A train batch is {'images': uint8 [b, S, S, C] (float32 for an array source of floats),
'labels': int32 [b], 'replaced': float32 [b]}; eval batches add 'weights' [b] (0 on the
padding of the last). With `device_views` (an in-memory source of uint8 images) the images
are sent as stored, [b, H, W, C], a train batch adds 'example' (step, row) int32 [b, 2], and the
step makes the views (`device_views.py`): the host only gathers them. Example
g = step x B + row of the endless train stream is image permutation(seed, epoch)[g % N], viewed
(`host_views.py`) with the generator seeded by (seed, g): a batch is a pure function of
(seed, step), and each process makes only its own rows, alike on any number of processes.

`workers` processes (spawned; they import numpy and Pillow, never jax) each make a share of
a batch, and the batches of the next `ahead` steps are in flight while one trains; 0 makes
them in the calling thread (the loop's prefetch thread), the default for in-memory sources.
Workers ignore SIGINT/SIGTERM (the run saves and stops; they exit with it) and exit when
their parent dies.

An image that cannot be read (truncated, not an image, missing) is replaced by the next
readable image of its split, named in one warning line, and counted: 'replaced' marks its
row, which the task counts (`train/replaced_images_since_last_log`, `eval/replaced_images`).
"""

import concurrent.futures
import concurrent.futures.process
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import weakref

import numpy as np
from PIL import Image

from transformer import console
from transformer.data import spawn
from transformer.data.images import host_views, normalisation
from transformer.data.images.splits import ArraySplit, Split, read_file

UNREADABLE = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)
MAX_TRIES = 16


def read_or_replace(split: Split, i: int):
    """(image i, or the next readable one; None, or (image i's name, why it was replaced))."""
    first = None
    for k in range(MAX_TRIES):
        try:
            image = split.read((i + k) % len(split))
        except UNREADABLE as e:
            first = first or f"{type(e).__name__}: {e}"
            continue
        return image, (split.name(i), first) if k else None
    raise ValueError(f"{split.name(i)} and the {MAX_TRIES - 1} images after it cannot be read ({first}): "
                     "is config.data.source the right folder?")


def read_image(path: str, config) -> np.ndarray:
    """An image file (any format PIL reads, or an .npy [H, W] or [H, W, C]) as the run's eval reads one
    (`host_views.eval_view`: converted, resized and centre-cropped; an .npy of floats as stored) -> raw
    pixels [H, W, C]."""
    try:
        x = host_views.eval_view(read_file(path), host_views.Recipe.of(config))
    except UNREADABLE as e:
        raise ValueError(f"{path}: cannot read image: {e}") from None
    m = config.model
    expected = (m.image_size, m.image_size, m.channels)
    if x.shape != expected:
        raise ValueError(f"{path}: image of shape {x.shape}, but this run reads {expected} (an .npy of floats is "
                         "not resized)")
    return x


def make_views(split: Split, recipe: host_views.Recipe, indices, seeds) -> tuple:
    """(views [n, S, S, C], replaced bool [n], [(name, why)]) of images `indices` of `split`: train views
    drawn with generators seeded by `seeds` [n, ...], or eval views where `seeds` is None."""
    views, replaced, notes = [], [], []
    for k, i in enumerate(indices):
        image, note = read_or_replace(split, int(i))
        if seeds is None:
            view = host_views.eval_view(image, recipe)
        else:
            view = host_views.train_view(image, recipe, np.random.default_rng([int(s) for s in seeds[k]]))
        shape = (recipe.image_size, recipe.image_size, recipe.channels)
        if view.shape != shape:
            raise ValueError(f"{split.name(int(i))}: image of shape {view.shape}, expected {shape} "
                             "(config.model.image_size, channels)")
        views.append(view)
        replaced.append(note is not None)
        notes += [note] if note else []
    return np.stack(views), np.array(replaced), notes


_WORKER = {}  # in a worker process: the run's splits and recipe


def _start_worker(splits: dict, recipe: host_views.Recipe) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    threading.Thread(target=lambda: (multiprocessing.connection.wait([parent.sentinel]), os._exit(0)),
                     daemon=True).start()
    _WORKER.update(splits=splits, recipe=recipe)


def _worker_views(split: str, indices, seeds):
    return make_views(_WORKER["splits"][split], _WORKER["recipe"], indices, seeds)


def start_pool(workers: int, splits: dict, recipe: host_views.Recipe) -> concurrent.futures.ProcessPoolExecutor:
    """`workers` spawned processes holding the splits (a file split travels as its index's name, an
    in-memory one as its shared memory's)."""
    for split in splits.values():
        if isinstance(split, ArraySplit):
            split.share()
    pool = concurrent.futures.ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"),
                                                  initializer=_start_worker, initargs=(splits, recipe))
    with spawn.main_not_reimported():  # processes start at the first submits: start them all here
        for f in [pool.submit(os.getpid) for _ in range(workers)]:
            f.result()
    return pool


class ImageData:
    """The train stream's and the eval split's batches (this process's rows), see the module docstring."""

    def __init__(self, splits: dict[str, Split], recipe: host_views.Recipe, batch_size: int, seed: int,
                 rows: np.ndarray | None = None, workers: int = 0, ahead: int = 2, device_views: bool = False):
        self.splits, self.recipe, self.batch_size, self.seed, self.ahead = splits, recipe, batch_size, seed, ahead
        self.device_views = device_views
        self.local = np.arange(batch_size) if rows is None else np.asarray(rows)
        self.workers = workers
        self.pool = start_pool(workers, splits, recipe) if workers else None
        if self.pool:
            weakref.finalize(self, self.pool.shutdown, wait=False, cancel_futures=True)
        self.pending: dict[int, list] = {}
        self.permutations: dict[int, np.ndarray] = {}
        self.named: set[str] = set()
        self.replaced = 0

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return self.recipe.image_size, self.recipe.image_size, self.recipe.channels

    def train_indices(self, step: int) -> np.ndarray:
        """The global batch's train image indices at `step`: positions of the stream of epoch permutations."""
        n = len(self.splits["train"])
        stream = step * self.batch_size + np.arange(self.batch_size)
        perms = {e: self.permutations[e] if e in self.permutations
                 else np.random.default_rng([self.seed, e]).permutation(n) for e in np.unique(stream // n)}
        self.permutations = perms  # the epochs of the last batch asked for: the next is most likely in them
        return np.array([perms[i // n][i % n] for i in stream])

    def _submit(self, split: str, indices: np.ndarray, seeds: np.ndarray | None) -> list:
        """The views of `indices`, made in `workers` shares (futures), or at once without workers."""
        if not self.pool:
            return [make_views(self.splits[split], self.recipe, indices, seeds)]
        shares = np.array_split(np.arange(len(indices)), min(self.workers, len(indices)))
        with self._worker_death_explained():
            return [self.pool.submit(_worker_views, split, indices[s], None if seeds is None else seeds[s])
                    for s in shares]

    @contextlib.contextmanager
    def _worker_death_explained(self):
        try:
            yield
        except concurrent.futures.process.BrokenProcessPool:
            raise RuntimeError(f"a data worker process died (killed for memory? see dmesg): lower config.data.workers "
                               f"(now {self.workers}); the last checkpoint is intact and the same command "
                               "resumes") from None

    def _collect(self, parts: list) -> tuple[np.ndarray, np.ndarray]:
        with self._worker_death_explained():
            done = [p.result() if isinstance(p, concurrent.futures.Future) else p for p in parts]
        for name, why in (note for _, _, notes in done for note in notes):
            self.replaced += 1
            if name not in self.named:
                self.named.add(name)
                print(f"images: skipped unreadable {name} ({why}); replaced by the next image of its split "
                      f"({self.replaced} replaced so far)", file=sys.stderr)
        views = np.concatenate([v for v, _, _ in done])
        return views if views.dtype == np.uint8 else views.astype(np.float32), np.concatenate([r for _, r, _ in done])

    def _submit_train(self, step: int) -> tuple[np.ndarray, list]:
        idx = self.train_indices(step)[self.local]
        seeds = np.stack([np.full(len(idx), self.seed), step * self.batch_size + self.local], axis=1)
        return idx, self._submit("train", idx, seeds)

    def train_batch(self, step: int) -> dict:
        """{'images', 'labels', 'replaced'}: this process's rows of step's batch (the next steps' queued);
        with `device_views` the images as stored and each row's (step, global row) as 'example' int32
        [b, 2], from which the step makes the views (`device_views`)."""
        if self.device_views:
            idx = self.train_indices(step)[self.local]
            split = self.splits["train"]
            return {"images": split.x[idx], "labels": split.labels[idx].astype(np.int32),
                    "replaced": np.zeros(len(idx), np.float32),
                    "example": np.stack([np.full(len(idx), step), self.local], axis=1).astype(np.int32)}
        for s in range(step, step + (self.ahead if self.pool else 0) + 1):  # without workers: just this step
            if s not in self.pending:
                self.pending[s] = self._submit_train(s)
        for s in [s for s in self.pending if s < step]:
            del self.pending[s]
        idx, parts = self.pending.pop(step)
        views, replaced = self._collect(parts)
        return {"images": views, "labels": self.splits["train"].labels[idx].astype(np.int32),
                "replaced": replaced.astype(np.float32)}

    def stream(self, split: str, parts: list[np.ndarray]):
        """Eval views of each index array of `parts` [n_i] in turn, the next ones in flight: (views, replaced)."""
        queued = {}
        for k in range(len(parts)):
            for j in range(k, min(k + self.ahead + 1, len(parts))):
                if j not in queued:
                    queued[j] = self._submit(split, parts[j], None)
            yield self._collect(queued.pop(k))

    def eval_batches(self):
        """The whole test split in batches of this process's rows (made as they are asked for); the last
        batch's padding rows (image 0 again) have `weights` 0."""
        test = self.splits["test"]
        rows = [start + self.local for start in range(0, len(test), self.batch_size)]
        real = [r < len(test) for r in rows]
        indices = [np.where(ok, r, 0) for r, ok in zip(rows, real)]
        views = ((test.x[idx], np.zeros(len(idx), bool)) for idx in indices) if self.device_views \
            else self.stream("test", indices)  # device views: the step resizes and crops (device_views)
        for idx, ok, (images_, replaced) in zip(indices, real, views):
            yield {"images": images_, "labels": np.where(ok, test.labels[idx], 0).astype(np.int32),
                   "weights": ok.astype(np.float32), "replaced": (replaced & ok).astype(np.float32)}

    def run_statistics(self, data_config, workdir: str, show: bool = False,
                       save: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The per-channel mean [C] and std [C] a run normalises by: fixed (config.data.mean, std), else
        those the run saved in `workdir`, else sampled now (`sampled_statistics`), and saved if `save`."""
        d = data_config
        saved = normalisation.recorded_statistics(d, workdir)
        if saved is not None:
            return saved
        sample = d.get("statistics_sample", 10_000)
        mean, std = self.sampled_statistics(sample, show)
        if save:
            n = min(len(self.splits["train"]), sample)
            normalisation.save_statistics(workdir, mean, std, f"{n} train images of {d.source}")
        return mean, std

    def sampled_statistics(self, sample: int, show: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel mean [C] and std [C] of the eval views of `normalisation.statistics_rows` of the train split."""
        rows = normalisation.statistics_rows(len(self.splits["train"]), sample)
        parts = np.array_split(rows, -(-len(rows) // 256))
        chunks = console.progress(self.stream("train", parts), desc=f"statistics of {len(rows):,} train images",
                              total=len(parts), disable=not show, leave=False)
        return normalisation.statistics(views for views, _ in chunks)
