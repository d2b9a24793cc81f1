"""The splits of an image source: labels [N] and how image i is read, from memory or from files.

Glossary of shapes: N images of a split, H/W height/width, C channels.

`ArraySplit` holds its images x [N, H, W, C]; `share()` moves them into shared memory before the
data workers start, so that every worker reads the one copy. `FileSplit` reads the image files
of a folder's index (folders.py), each decoded as a batch needs it. A source without its own
test split is split by a fixed permutation (`split`).
"""

import os
import weakref
from multiprocessing import shared_memory

import numpy as np

SPLIT_SEED = 0


def split(x: np.ndarray, y: np.ndarray, test_fraction: float) -> dict:
    """A fixed permutation's first `test_fraction` of the images is the test split."""
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return {"train": (x[train], y[train]), "test": (x[test], y[test])}


class Split:
    """One split of a source: labels [N] int64 and how image i is read (`read`, named by `name`)."""

    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


class ArraySplit(Split):
    """Images held in memory: x [N, H, W, C]. `share()` moves them into shared memory, after which the split
    is pickled (to the data workers) as the segment's name: every worker reads the one copy."""

    def __init__(self, x: np.ndarray, labels: np.ndarray, source: str):
        self.x, self.labels, self.source = x, labels, source
        self.segment = None

    def share(self) -> None:
        if self.segment is None:
            self.segment = shared_memory.SharedMemory(create=True, size=max(self.x.nbytes, 1))
            shared = np.ndarray(self.x.shape, self.x.dtype, buffer=self.segment.buf)
            shared[...] = self.x
            self.x = shared
            weakref.finalize(self, _release, self.segment)

    def __getstate__(self):
        if self.segment is None:
            return self.__dict__
        return {"name": self.segment.name, "shape": self.x.shape, "dtype": self.x.dtype.str, "labels": self.labels,
                "source": self.source}

    def __setstate__(self, state):
        if "name" not in state:
            self.__dict__.update(state)
            return
        self.segment = shared_memory.SharedMemory(name=state["name"])  # spawned: the parent's tracker unlinks it
        self.x = np.ndarray(state["shape"], np.dtype(state["dtype"]), buffer=self.segment.buf)
        self.labels, self.source = state["labels"], state["source"]

    def read(self, i: int) -> np.ndarray:
        return self.x[i]

    def name(self, i: int) -> str:
        return f"{self.source}[{i}]"


def _release(segment: shared_memory.SharedMemory) -> None:
    segment.close()
    segment.unlink()


class FileSplit(Split):
    """Images as files: paths [N] (bytes, relative to `root`), memory-mapped from the run's index;
    pickled (to the data workers) as the index's file name, not its contents."""

    def __init__(self, root: str, paths_file: str, labels_file: str):
        self.root, self.paths_file, self.labels_file = root, paths_file, labels_file
        self.paths = np.load(paths_file, mmap_mode="r")
        self.labels = np.load(labels_file, mmap_mode="r")

    def __getstate__(self):
        return (self.root, self.paths_file, self.labels_file)

    def __setstate__(self, state):
        self.__init__(*state)

    def name(self, i: int) -> str:
        return os.path.join(self.root, self.paths[i].decode())

    def read(self, i: int):
        return read_file(self.name(i))


def header(path: str) -> tuple[int, int, int]:
    """(H, W, C) of an image file from its header alone (nothing decoded): C is 1 for a grayscale image
    (one channel; PIL modes 1, L, LA, I, F), else 3, as a view converts it (host_views.as_pil)."""
    if path.endswith(".npy"):
        shape = np.load(path, mmap_mode="r").shape
        return shape[0], shape[1], 1 if len(shape) == 2 or shape[2] == 1 else 3
    from PIL import Image
    with Image.open(path) as image:
        grey = image.mode in ("1", "L", "LA", "La", "F") or image.mode.startswith("I")
        return image.height, image.width, 1 if grey else 3


def read_file(path: str):
    """An image file: an .npy array [H, W(, C)] as stored, any other file decoded by PIL (fully: a
    truncated file fails here, not later)."""
    if path.endswith(".npy"):
        x = np.load(path)
        return x[..., None] if x.ndim == 2 else x
    from PIL import Image
    image = Image.open(path)
    image.load()
    return image
