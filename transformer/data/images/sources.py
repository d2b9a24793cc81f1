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

import glob
import gzip
import os

import numpy as np

from transformer.data.images import folders
from transformer.data.images.splits import ArraySplit, Split, split

IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
TEST_PREFIXES = ("t10k", "test")


def _with_channels(x: np.ndarray, name: str) -> np.ndarray:
    """[N, H, W] -> [N, H, W, 1]; [N, H, W, C] unchanged; anything else fails naming `name`."""
    if x.ndim == 3:
        return x[..., None]
    if x.ndim != 4:
        raise ValueError(f"{name}: images must be [N, H, W] or [N, H, W, C], got shape {x.shape}")
    return x


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
        elif not folders.is_folder_of_files(path):
            arrays = load_idx(path)
        else:
            return folders.open_index(c, workdir, show)[1]
    return {s: ArraySplit(x, y, c.source) for s, (x, y) in arrays.items()}
