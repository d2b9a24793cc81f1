"""Image classification sources: in-memory arrays, or a folder of image files indexed once.

Glossary of shapes: N images of a split, H/W height/width, C channels.

`config.data.source` is one of
  digits                   scikit-learn's 1,797 8 x 8 digits (embedded; values 0..16 scaled to 0..255)
  DIR of IDX files         MNIST-family `PREFIX-images-idx3-ubyte[.gz]` + `PREFIX-labels-idx1-ubyte[.gz]`;
                           prefix train -> train split, t10k or test -> test split
  FILE.npz                 arrays x [N, H, W(, C)] and y [N], optional x_test, y_test
  DIR of class folders     ImageFolder: DIR/train/CLASS/* with DIR/val/CLASS/* or DIR/test/CLASS/*,
                           or DIR/CLASS/*; ImageNet's flat DIR/val/* with `config.data.val_labels`
                           (lines `FILE,CLASS ...`: its LOC_val_solution.csv, or `FILE<tab>CLASS`);
                           class names sorted -> ids; files are JPEG/PNG/BMP/GIF/WebP, or .npy
                           arrays [H, W(, C)]
Sources without their own test split are split by a fixed permutation (`test_fraction`).

The first three are read into memory (they are small); a folder is indexed once (file names
and labels, nothing decoded) into WORKDIR/images/ and its files are read as batches need
them (`data/image_batches.py`). Both are `Split`s: labels [N] and `read(i)`. Pixels are
normalised on the device by per-channel statistics: fixed ones (`config.data.mean`, `std`)
or those of a fixed sample of the train split (`statistics_sample` images, all of a small
split), saved in WORKDIR/images/statistics.json and reused by a resumed run and the probes.
"""

import contextlib
import glob
import gzip
import json
import os
import shutil
import sys
import weakref
from multiprocessing import shared_memory

import numpy as np

from transformer import cli

SPLIT_SEED = 0
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
TEST_PREFIXES = ("t10k", "test")


def _with_channels(x: np.ndarray, name: str) -> np.ndarray:
    """[N, H, W] -> [N, H, W, 1]; [N, H, W, C] unchanged; anything else fails naming `name`."""
    if x.ndim == 3:
        return x[..., None]
    if x.ndim != 4:
        raise ValueError(f"{name}: images must be [N, H, W] or [N, H, W, C], got shape {x.shape}")
    return x


def split(x: np.ndarray, y: np.ndarray, test_fraction: float) -> dict:
    """A fixed permutation's first `test_fraction` of the images is the test split."""
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return {"train": (x[train], y[train]), "test": (x[test], y[test])}


def load_digits(test_fraction: float) -> dict:
    """scikit-learn's 8 x 8 digits as uint8 [N, 8, 8, 1] in 0..255."""
    from sklearn.datasets import load_digits as sklearn_digits
    digits = sklearn_digits()
    x = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]  # [N, 8, 8, 1]
    return split(x, digits.target.astype(np.int64), test_fraction)


def read_idx(path: str) -> np.ndarray:
    """An IDX file (optionally gzipped) as a numpy array; a bad header fails naming the file."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise ValueError(f"{path}: cannot read IDX file: {e}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in IDX_DTYPES:
        raise ValueError(f"{path}: bad IDX magic number {data[:4].hex() or '(empty)'} "
                         "(expected 0000 then a type code and the number of dimensions)")
    ndim, dtype = data[3], np.dtype(IDX_DTYPES[data[2]])
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: IDX header truncated ({len(data)} bytes for {ndim} dimensions)")
    shape = tuple(int(d) for d in np.frombuffer(data[4:header], ">u4"))
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) - header != expected:
        raise ValueError(f"{path}: IDX header says shape {shape} ({expected} bytes) but "
                         f"{len(data) - header} bytes follow")
    return np.frombuffer(data, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def load_idx(directory: str) -> dict:
    """MNIST-family IDX pairs in `directory`, split by their prefix (train | t10k, test)."""
    splits = {}
    for images_path in sorted(glob.glob(os.path.join(directory, "*-images-idx3-ubyte*"))):
        prefix = os.path.basename(images_path).split("-images-")[0]
        labels = glob.glob(os.path.join(directory, f"{prefix}-labels-idx1-ubyte*"))
        if not labels:
            raise ValueError(f"{images_path}: no matching {prefix}-labels-idx1-ubyte[.gz] in {directory}")
        x, y = _with_channels(read_idx(images_path), images_path), read_idx(labels[0])
        if y.ndim != 1 or len(y) != len(x):
            raise ValueError(f"{labels[0]}: {y.shape} labels for {len(x)} images in {images_path}")
        splits["test" if prefix.lower() in TEST_PREFIXES else "train"] = (x, y.astype(np.int64))
    if "train" not in splits or "test" not in splits:
        raise ValueError(f"{directory}: needs train-* and t10k-* (or test-*) IDX image/label pairs")
    return splits


def load_npz(path: str, test_fraction: float) -> dict:
    """`x`, `y` (and optional `x_test`, `y_test`) from an .npz file."""
    try:
        arrays = dict(np.load(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read .npz: {e}") from None
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        raise ValueError(f"{path}: missing array(s) {', '.join(missing)} (has {', '.join(arrays) or 'none'})")
    pairs = {"train": ("x", "y"), "test": ("x_test", "y_test")} if "x_test" in arrays else {"all": ("x", "y")}
    splits = {}
    for name, (xk, yk) in pairs.items():
        x, y = _with_channels(arrays[xk], f"{path}:{xk}"), arrays[yk].astype(np.int64)
        if y.shape != (len(x),):
            raise ValueError(f"{path}: {yk} has shape {y.shape}, expected ({len(x)},)")
        splits[name] = (x, y)
    return split(*splits["all"], test_fraction) if "all" in splits else splits


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


def _image_files(folder: str) -> list[str]:
    with os.scandir(folder) as entries:
        return sorted(e.name for e in entries if e.is_file() and e.name.lower().endswith((".npy", *IMAGE_EXTENSIONS)))


def _classes(base: str) -> list[str]:
    classes = sorted(d for d in os.listdir(base) if os.path.isdir(os.path.join(base, d)))
    if not classes:
        raise ValueError(f"{base}: no class sub-folders")
    return classes


def index_class_folders(root: str, base: str, classes: list[str], show: bool) -> tuple[list[str], list[int]]:
    """(paths relative to `root`, labels) of the image files in base/CLASS/, classes in order."""
    paths, labels = [], []
    for label, name in enumerate(cli.progress(classes, desc=f"indexing {base}", disable=not show, leave=False)):
        folder = os.path.join(base, name)
        files = _image_files(folder)
        paths += [os.path.relpath(os.path.join(folder, f), root) for f in files]
        labels += [label] * len(files)
    if not paths:
        raise ValueError(f"{base}: no images (.npy, {', '.join(IMAGE_EXTENSIONS)}) in its class folders")
    return paths, labels


def index_flat_folder(root: str, folder: str, classes: list[str], labels_file: str) -> tuple[list[str], list[int]]:
    """ImageNet's flat val/: each file's class from `labels_file`, lines `FILE,CLASS ...` or `FILE<tab>CLASS`
    (CLASS a class folder's name or its id; FILE with or without its extension; a header line is skipped)."""
    ids = {name: i for i, name in enumerate(classes)}
    by_stem = {}
    with open(os.path.expanduser(labels_file)) as f:
        for number, line in enumerate(f, 1):
            fields = line.replace(",", "\t", 1).split("\t") if "," in line or "\t" in line else line.split(None, 1)
            if len(fields) < 2:
                continue
            name, value = fields[0].strip(), (fields[1].split() or [""])[0]
            label = ids.get(value, int(value) if value.isdigit() else None)
            if label is None or not 0 <= label < len(classes):
                if number == 1:
                    continue  # a header
                raise ValueError(f"{labels_file}:{number}: {value!r} is neither a class folder of the train split "
                                 f"nor an id below {len(classes)}")
            by_stem[os.path.splitext(os.path.basename(name))[0]] = label
    files = _image_files(folder)
    missing = [f for f in files if os.path.splitext(f)[0] not in by_stem]
    if missing:
        raise ValueError(f"{labels_file}: no label for {len(missing)} file(s) of {folder}, e.g. {missing[0]}")
    return [os.path.relpath(os.path.join(folder, f), root) for f in files], [by_stem[os.path.splitext(f)[0]]
                                                                            for f in files]


def index_folder(root: str, test_fraction: float, val_labels: str = "", show: bool = False) -> tuple[list, dict]:
    """(class names, {'train': (paths, labels), 'test': (...)}) of an image folder (see the module docstring)."""
    evals = [s for s in ("val", "test") if os.path.isdir(os.path.join(root, s))]
    if not os.path.isdir(os.path.join(root, "train")) or not evals:
        classes = _classes(root)
        paths, labels = index_class_folders(root, root, classes, show)
        order = np.random.default_rng(SPLIT_SEED).permutation(len(paths))
        n_test = int(round(len(paths) * test_fraction))
        pick = lambda rows: ([paths[i] for i in rows], [labels[i] for i in rows])  # noqa: E731
        return classes, {"train": pick(order[n_test:]), "test": pick(order[:n_test])}
    classes = _classes(os.path.join(root, "train"))
    held_out = os.path.join(root, evals[0])
    splits = {"train": index_class_folders(root, os.path.join(root, "train"), classes, show)}
    if val_labels:
        splits["test"] = index_flat_folder(root, held_out, classes, val_labels)
    else:
        if _classes(held_out) != classes:
            raise ValueError(f"{held_out}: its class folders differ from {os.path.join(root, 'train')}'s (a flat "
                             "folder of files needs config.data.val_labels)")
        splits["test"] = index_class_folders(root, held_out, classes, show)
    return classes, splits


INDEX_DIR = "images"


def open_index(data_config, workdir: str, show: bool) -> tuple[list[str], dict[str, FileSplit]]:
    """(class names, {'train', 'test': FileSplit}) of the folder `config.data.source`: indexed into
    WORKDIR/images/ the first time, read back after (a resumed run sees the files it was started on)."""
    root = os.path.abspath(os.path.expanduser(data_config.source))
    out = os.path.join(workdir, INDEX_DIR)
    record_path = os.path.join(out, "index.json")
    wanted = {"source": root, "val_labels": data_config.val_labels, "test_fraction": data_config.test_fraction}
    record = json.load(open(record_path)) if os.path.exists(record_path) else {}
    if {k: record.get(k) for k in wanted} != wanted:
        classes, splits = index_folder(root, data_config.test_fraction, data_config.val_labels, show)
        os.makedirs(out, exist_ok=True)
        for name, (paths, labels) in splits.items():
            _save(os.path.join(out, f"{name}_paths.npy"), np.array(paths, dtype=np.bytes_))
            _save(os.path.join(out, f"{name}_labels.npy"), np.array(labels, np.int64))
        record = wanted | {"classes": classes, "counts": {s: len(p) for s, (p, _) in splits.items()}}
        _save_json(record_path, record)
        if show:
            print(f"images: indexed {root}: {len(classes)} classes, " + ", ".join(
                f"{n:,} {s}" for s, n in record["counts"].items()) + f" -> {out}", file=sys.stderr)
    return record["classes"], {s: FileSplit(root, os.path.join(out, f"{s}_paths.npy"),
                                            os.path.join(out, f"{s}_labels.npy")) for s in ("train", "test")}


def share_index(data_config, workdir: str, run_dirs: list[str], show: bool = False) -> None:
    """Indexes the folder `config.data.source` into WORKDIR/images (`open_index`) and hard-links that index
    into each of `run_dirs` (copies where a link cannot be made) that has none: a sweep's trials then read
    one index instead of each scanning the folder (ImageNet's 1.3 million files). The record goes in
    last, so an interrupted share leaves a run that indexes for itself."""
    open_index(data_config, workdir, show)
    source = os.path.join(workdir, INDEX_DIR)
    files = sorted(f for f in os.listdir(source) if f.endswith(".npy")) + ["index.json"]
    for run_dir in run_dirs:
        target = os.path.join(run_dir, INDEX_DIR)
        if os.path.exists(os.path.join(target, "index.json")):
            continue
        os.makedirs(target, exist_ok=True)
        for name in files:
            _link(os.path.join(source, name), os.path.join(target, name))


def _link(source: str, target: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(target)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _save(path: str, array: np.ndarray) -> None:
    with open(path + ".tmp", "wb") as f:
        np.save(f, array)
    os.replace(path + ".tmp", path)


def _save_json(path: str, record: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)


def is_folder_of_files(source: str) -> bool:
    path = os.path.expanduser(source)
    return os.path.isdir(path) and not glob.glob(os.path.join(path, "*-images-idx3-ubyte*"))


def load(data_config, workdir: str, show: bool = False) -> dict[str, Split]:
    """{'train': Split, 'test': Split} of `config.data.source` (see the module docstring)."""
    c = data_config
    if c.source == "digits":
        arrays = load_digits(c.test_fraction)
    else:
        path = os.path.expanduser(c.source)
        if path.endswith(".npz"):
            arrays = load_npz(path, c.test_fraction)
        elif not os.path.isdir(path):
            raise ValueError(f"config.data.source={c.source!r}: not 'digits', an .npz file or a folder")
        elif not is_folder_of_files(path):
            arrays = load_idx(path)
        else:
            return open_index(c, workdir, show)[1]
    return {s: ArraySplit(x, y, c.source) for s, (x, y) in arrays.items()}


def statistics(chunks) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean [C] and std [C] (at least 1e-6), float32, of the images of chunks [n, H, W, C]
    (accumulated in float64: the same numbers however the images are chunked)."""
    total, squares, count = 0.0, 0.0, 0
    for x in chunks:
        x = np.asarray(x, np.float64)
        total, squares = total + x.sum(axis=(0, 1, 2)), squares + (x ** 2).sum(axis=(0, 1, 2))
        count += x[..., 0].size
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean ** 2, 0.0))
    return mean.astype(np.float32), np.maximum(std, 1e-6).astype(np.float32)


def statistics_rows(n: int, sample: int) -> np.ndarray:
    """The train images that sampled statistics are computed over: all of a split of at most `sample`,
    else a fixed random `sample` of them (sorted)."""
    if n <= sample:
        return np.arange(n)
    return np.sort(np.random.default_rng(SPLIT_SEED).permutation(n)[:sample])


STATISTICS = "statistics.json"


def saved_statistics(workdir: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The (mean [C], std [C]) a run in `workdir` normalises by, or None before it computed them."""
    path = os.path.join(workdir, INDEX_DIR, STATISTICS)
    if not os.path.exists(path):
        return None
    record = json.load(open(path))
    return np.asarray(record["mean"], np.float32), np.asarray(record["std"], np.float32)


def save_statistics(workdir: str, mean: np.ndarray, std: np.ndarray, how: str) -> None:
    os.makedirs(os.path.join(workdir, INDEX_DIR), exist_ok=True)
    _save_json(os.path.join(workdir, INDEX_DIR, STATISTICS),
               {"mean": [float(v) for v in mean], "std": [float(v) for v in std], "from": how})


def normalise(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Images [..., H, W, C] as the model reads them: float32, each channel less its mean over its std
    (the training step does the same on the device, to the uint8 images of a batch)."""
    return (x.astype(np.float32) - mean) / std
