"""Image classification sources: `load` reads `config.data.source` into {'train', 'test'} splits.

Glossary of shapes: N images of a split, H/W height/width, C channels.

`config.data.source` is one of
  digits                   scikit-learn's 1,797 8 x 8 digits (embedded; values 0..16 scaled to 0..255)
  DIR of IDX files         MNIST-family `PREFIX-images-idx3-ubyte[.gz]` + `PREFIX-labels-idx1-ubyte[.gz]`;
                           prefix train -> train split, t10k or test -> test split
  FILE.npz                 arrays x [N, H, W(, C)] and y [N], optional x_test, y_test
  DIR of class folders     ImageFolder, or ImageNet's flat val/ with `config.data.val_labels` (folders.py)
Sources without their own test split are split by a fixed permutation (`test_fraction`).

The first three are read into memory (they are small: `splits.ArraySplit`); a folder is indexed
once into WORKDIR/images/ and its files are read as batches need them (`splits.FileSplit`,
batches.py). Both are `Split`s: labels [N] and `read(i)`.
"""

import contextlib
import dataclasses
import glob
import gzip
import os
import zipfile

import numpy as np

from transformer.data.images import folders
from transformer.data.images.splits import ArraySplit, Split, header, split

IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
TEST_PREFIXES = ("t10k", "test")


def _check_rank(shape: tuple[int, ...], name: str) -> None:
    if len(shape) not in (3, 4):
        raise ValueError(f"{name}: images must be [N, H, W] or [N, H, W, C], got shape {shape}")


def _with_channels(x: np.ndarray, name: str) -> np.ndarray:
    """[N, H, W] -> [N, H, W, 1]; [N, H, W, C] unchanged; anything else fails naming `name`."""
    _check_rank(x.shape, name)
    return x[..., None] if x.ndim == 3 else x


def load_digits(test_fraction: float) -> dict:
    """scikit-learn's 8 x 8 digits as uint8 [N, 8, 8, 1] in 0..255."""
    from sklearn.datasets import load_digits as sklearn_digits
    digits = sklearn_digits()
    x = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]  # [N, 8, 8, 1]
    return split(x, digits.target.astype(np.int64), test_fraction)


def _read_idx_bytes(path: str, size: int = -1) -> bytes:
    """The first `size` bytes (-1: all) of an IDX file (optionally gzipped), its magic number checked."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read(size)
    except (OSError, EOFError) as e:
        raise ValueError(f"{path}: cannot read IDX file: {e}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in IDX_DTYPES:
        raise ValueError(f"{path}: bad IDX magic number {data[:4].hex() or '(empty)'} "
                         "(expected 0000 then a type code and the number of dimensions)")
    return data


def idx_shape(path: str) -> tuple[int, ...]:
    """The shape an IDX file's header gives (the header alone is read)."""
    head = _read_idx_bytes(path, 4 + 4 * 255)
    return tuple(int(d) for d in np.frombuffer(head[4:4 + 4 * head[3]], ">u4"))


def read_idx(path: str) -> np.ndarray:
    """An IDX file (optionally gzipped) as a numpy array; a bad header fails naming the file."""
    data = _read_idx_bytes(path)
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


def _idx_pairs(directory: str) -> list[tuple[str, str, str]]:
    """(split, images file, labels file) of each MNIST-family IDX pair in `directory` (train | t10k, test)."""
    pairs = []
    for images_path in sorted(glob.glob(os.path.join(directory, "*-images-idx3-ubyte*"))):
        prefix = os.path.basename(images_path).split("-images-")[0]
        labels = glob.glob(os.path.join(directory, f"{prefix}-labels-idx1-ubyte*"))
        if not labels:
            raise ValueError(f"{images_path}: no matching {prefix}-labels-idx1-ubyte[.gz] in {directory}")
        pairs.append(("test" if prefix.lower() in TEST_PREFIXES else "train", images_path, labels[0]))
    if {split for split, _, _ in pairs} != {"train", "test"}:
        raise ValueError(f"{directory}: needs train-* and t10k-* (or test-*) IDX image/label pairs")
    return pairs


def load_idx(directory: str) -> dict:
    """MNIST-family IDX pairs in `directory`, split by their prefix (train | t10k, test)."""
    splits = {}
    for name, images_path, labels_path in _idx_pairs(directory):
        x, y = _with_channels(read_idx(images_path), images_path), read_idx(labels_path)
        if y.ndim != 1 or len(y) != len(x):
            raise ValueError(f"{labels_path}: {y.shape} labels for {len(x)} images in {images_path}")
        splits[name] = (x, y.astype(np.int64))
    return splits


def _check_npz(path: str, names) -> None:
    missing = [k for k in ("x", "y") if k not in names]
    if missing:
        raise ValueError(f"{path}: missing array(s) {', '.join(missing)} (has {', '.join(names) or 'none'})")


def load_npz(path: str, test_fraction: float) -> dict:
    """`x`, `y` (and optional `x_test`, `y_test`) from an .npz file."""
    try:
        arrays = dict(np.load(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read .npz: {e}") from None
    _check_npz(path, list(arrays))
    pairs = {"train": ("x", "y"), "test": ("x_test", "y_test")} if "x_test" in arrays else {"all": ("x", "y")}
    splits = {}
    for name, (xk, yk) in pairs.items():
        x, y = _with_channels(arrays[xk], f"{path}:{xk}"), arrays[yk].astype(np.int64)
        if y.shape != (len(x),):
            raise ValueError(f"{path}: {yk} has shape {y.shape}, expected ({len(x)},)")
        splits[name] = (x, y)
    return split(*splits["all"], test_fraction) if "all" in splits else splits


def _kind(source: str) -> str:
    """digits | npz | idx | folder: what `config.data.source` names (anything else fails naming the key)."""
    path = os.path.expanduser(source)
    if source == "digits" or path.endswith(".npz"):
        return "digits" if source == "digits" else "npz"
    if not os.path.isdir(path):
        raise ValueError(f"config.data.source={source!r}: not 'digits', an .npz file or a folder")
    return "folder" if folders.is_folder_of_files(path) else "idx"


def load(data_config, workdir: str, show: bool = False, names: list[str] | None = None) -> dict[str, Split]:
    """{'train': Split, 'test': Split} of `config.data.source` (see the module docstring); a folder's
    class ids are those of `names` where the run names its classes."""
    c = data_config
    kind, path = _kind(c.source), os.path.expanduser(c.source)
    if kind == "folder":
        return folders.open_index(c, workdir, show, names)[1]
    arrays = {"digits": lambda: load_digits(c.test_fraction), "npz": lambda: load_npz(path, c.test_fraction),
              "idx": lambda: load_idx(path)}[kind]()
    return {s: ArraySplit(x, y, c.source) for s, (x, y) in arrays.items()}


@dataclasses.dataclass(frozen=True)
class Holds:
    """What an image source holds, read without loading its images: its classes (a folder's class folders,
    else the labels' largest + 1), its images' channels (C, or 3 where any image of a folder's sample has
    colour) and the (H, W) of the images looked at (of a folder: a sample of its files)."""

    classes: int
    channels: int
    sides: tuple[tuple[int, int], ...]
    files: bool  # image files, converted to the model's channels as they are read (arrays must have them)


DIGITS = Holds(classes=10, channels=1, sides=((8, 8),), files=False)  # what load_digits gives
UNREADABLE = (OSError, ValueError, SyntaxError, EOFError)


def describe(data_config) -> Holds:
    """What `config.data.source` holds (`Holds`), from headers, labels and class folders alone."""
    c = data_config
    kind, path = _kind(c.source), os.path.expanduser(c.source)
    if kind == "digits":
        return DIGITS
    if kind == "folder":
        classes, files = folders.sample(c)
        heads = []
        for file in files:
            with contextlib.suppress(*UNREADABLE):  # batches.py replaces such a file and says so
                heads.append(header(file))
        if not heads:
            raise ValueError(f"config.data.source={c.source!r}: none of {len(files)} sampled images can be read, "
                             f"e.g. {files[0]}")
        return Holds(len(classes), max(h[2] for h in heads), tuple((h, w) for h, w, _ in heads), files=True)
    if kind == "idx":
        pairs = _idx_pairs(path)
        shapes = [idx_shape(images) for _, images, _ in pairs]
        labels = [read_idx(labels) for _, _, labels in pairs]
    else:
        try:
            with np.load(path) as arrays:
                _check_npz(path, arrays.files)
                shapes = [_npy_shape(arrays.zip, f"{k}.npy") for k in ("x", "x_test") if k in arrays.files]
                labels = [arrays[k] for k in ("y", "y_test") if k in arrays.files]
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: cannot read .npz: {e}") from None
    for shape in shapes:
        _check_rank(shape, c.source)
    return Holds(max((int(y.max()) if y.size else -1) for y in labels) + 1, 1 if len(shapes[0]) == 3 else shapes[0][3],
                 tuple(dict.fromkeys(tuple(shape[1:3]) for shape in shapes)), files=False)


def _npy_shape(archive: zipfile.ZipFile, member: str) -> tuple[int, ...]:
    """The shape in the header of an .npy member of an .npz archive (nothing else read)."""
    with archive.open(member) as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        return read(f)[0]
