"""Image classification data: sources -> normalised, deterministic batches.

Glossary of shapes: N images, B batch, H/W height/width, C channels.

`config.data.source` is one of
  digits                   scikit-learn's 1,797 8 x 8 digits (embedded; values 0..16 scaled to 0..255)
  DIR of class folders     ImageFolder: DIR/CLASS/* or DIR/train/CLASS/* + DIR/test/CLASS/*; class
                           names sorted -> ids; files are .npy arrays [H, W] or [H, W, C], and
                           PNG/JPEG/BMP/GIF when Pillow is installed
  DIR of IDX files         MNIST-family `PREFIX-images-idx3-ubyte[.gz]` + `PREFIX-labels-idx1-ubyte[.gz]`;
                           prefix train -> train split, t10k or test -> test split
  FILE.npz                 arrays x [N, H, W(, C)] and y [N], optional x_test, y_test
Sources without their own test split are split by a fixed permutation (`test_fraction`).

Pixels are normalised per channel with the mean and std of the train split. A train
batch is a pure function of (seed, step): image i of the endless stream of epochs is
permutation(seed, epoch)[i % N], and augmentation (random crop with padding, horizontal
flip; both off by default) draws from `np.random.default_rng([seed, step])`. Eval batches
cover the whole test split; the last one is padded and `weights` marks the real images.
"""

import glob
import gzip
import os

import numpy as np

SPLIT_SEED = 0
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
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


def read_image(path: str, image_size: int, channels: int) -> np.ndarray:
    """One image file as [H, W, C], as a class folder's are read: an .npy array as stored, any other
    file through PIL, converted to `channels` and resized to `image_size`; a file that is not an
    image fails naming it."""
    try:
        x = np.load(path) if path.endswith(".npy") else _read_with_pil(path, image_size, channels)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read image: {e}") from None
    return x[..., None] if x.ndim == 2 else x


def _read_with_pil(path: str, image_size: int, channels: int) -> np.ndarray:
    """A PNG/JPEG/... converted to `channels` (L or RGB) and resized to image_size x image_size."""
    try:
        from PIL import Image
    except ImportError:
        raise ValueError(f"reading {os.path.splitext(path)[1]} images needs Pillow "
                         "(pip install pillow); or store the images as .npy") from None
    with Image.open(path) as image:
        image = image.convert("L" if channels == 1 else "RGB")
        if image.size != (image_size, image_size):
            image = image.resize((image_size, image_size), Image.BILINEAR)
        return np.asarray(image)


def _read_class_folders(root: str, classes: list[str], image_size: int, channels: int):
    xs, ys = [], []
    for label, name in enumerate(classes):
        for path in sorted(glob.glob(os.path.join(root, name, "*"))):
            if path.lower().endswith((".npy", *IMAGE_EXTENSIONS)):
                x = read_image(path, image_size, channels)
                if x.shape != (image_size, image_size, channels):
                    raise ValueError(f"{path}: image of shape {x.shape}, expected "
                                     f"{(image_size, image_size, channels)} (config.model.image_size, channels)")
                xs.append(x)
                ys.append(label)
    if not xs:
        raise ValueError(f"{root}: no images (.npy, {', '.join(IMAGE_EXTENSIONS)}) in its class folders")
    return np.stack(xs), np.array(ys, np.int64)


def load_folder(root: str, image_size: int, channels: int, test_fraction: float) -> dict:
    """ImageFolder: class sub-folders (sorted names -> ids), with or without train/ and test/."""
    has_splits = all(os.path.isdir(os.path.join(root, s)) for s in ("train", "test"))
    base = os.path.join(root, "train") if has_splits else root
    classes = sorted(d for d in os.listdir(base) if os.path.isdir(os.path.join(base, d)))
    if not classes:
        raise ValueError(f"{base}: no class sub-folders")
    if not has_splits:
        return split(*_read_class_folders(root, classes, image_size, channels), test_fraction)
    return {s: _read_class_folders(os.path.join(root, s), classes, image_size, channels)
            for s in ("train", "test")}


def load(data_config, image_size: int, channels: int) -> dict:
    """{'train': (x [N, H, W, C], y [N]), 'test': (...)} from `config.data.source`.

    Images in a class folder must be `image_size` x `image_size` x `channels` (PIL ones are
    converted and resized to it).
    """
    c = data_config
    if c.source == "digits":
        return load_digits(c.test_fraction)
    path = os.path.expanduser(c.source)
    if path.endswith(".npz"):
        return load_npz(path, c.test_fraction)
    if not os.path.isdir(path):
        raise ValueError(f"config.data.source={c.source!r}: not 'digits', an .npz file or a folder")
    if glob.glob(os.path.join(path, "*-images-idx3-ubyte*")):
        return load_idx(path)
    return load_folder(path, image_size, channels, c.test_fraction)


def statistics(x_train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The train split's per-channel mean [C] and std [C] (at least 1e-6) that normalise every image."""
    train = x_train.astype(np.float32)
    return train.mean(axis=(0, 1, 2)), np.maximum(train.std(axis=(0, 1, 2)), 1e-6)


def normalise(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Images [..., H, W, C] as the model reads them: float32, each channel less its mean over its std."""
    return (x.astype(np.float32) - mean) / std


class ImageData:
    """Normalised train/test arrays and the batches cut from them (this process's rows)."""

    def __init__(self, splits: dict, batch_size: int, seed: int, augment: bool = False, crop_padding: int = 0,
                 flip: bool = False, rows: np.ndarray | None = None):
        x_train, self.y_train = splits["train"]
        x_test, self.y_test = splits["test"]
        if not len(self.y_train) or not len(self.y_test):
            raise ValueError(f"{len(self.y_train)} train and {len(self.y_test)} test images: both splits need "
                             "images (config.data.test_fraction)")
        if x_test.shape[1:] != x_train.shape[1:]:
            raise ValueError(f"test images are {x_test.shape[1:]} but train images {x_train.shape[1:]}")
        self.mean, self.std = statistics(x_train)
        self.x_train = normalise(x_train, self.mean, self.std)
        self.x_test = normalise(x_test, self.mean, self.std)
        self.batch_size, self.seed = batch_size, seed
        self.augment, self.crop_padding, self.flip = augment, crop_padding, flip
        self.local = np.arange(batch_size) if rows is None else np.asarray(rows)  # this process's rows

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return self.x_train.shape[1:]

    def train_indices(self, step: int) -> np.ndarray:
        """The global batch's image indices at `step`: positions of the stream of epoch permutations."""
        n = len(self.x_train)
        stream = step * self.batch_size + np.arange(self.batch_size)
        perms = {e: np.random.default_rng([self.seed, e]).permutation(n) for e in np.unique(stream // n)}
        return np.array([perms[i // n][i % n] for i in stream])

    def train_batch(self, step: int) -> dict:
        """{'images': float32 [B, H, W, C], 'labels': int32 [B]}: this process's rows of step's batch."""
        idx = self.train_indices(step)[self.local]
        images = self.x_train[idx]
        if self.augment:
            images = augment(images, np.random.default_rng([self.seed, step]), self.crop_padding, self.flip,
                             rows=self.local, batch_size=self.batch_size)
        return {"images": images, "labels": self.y_train[idx].astype(np.int32)}

    def eval_batches(self) -> list[dict]:
        """The whole test split in batches; `weights` is 0 on the padding of the last batch."""
        batches = []
        for start in range(0, len(self.x_test), self.batch_size):
            x, y = self.x_test[start:start + self.batch_size], self.y_test[start:start + self.batch_size]
            pad = self.batch_size - len(x)
            batch = {"images": np.pad(x, ((0, pad), (0, 0), (0, 0), (0, 0))),
                     "labels": np.pad(y, (0, pad)).astype(np.int32),
                     "weights": np.pad(np.ones(len(x), np.float32), (0, pad))}
            batches.append({k: v[self.local] for k, v in batch.items()})
        return batches


def augment(images: np.ndarray, rng: np.random.Generator, padding: int, flip: bool,
            rows: slice = slice(None), batch_size: int | None = None) -> np.ndarray:
    """Random crop of each image from it padded by `padding` (zeros: the mean), and optional flips.

    `images` are rows `rows` of a batch of `batch_size` (default: all of it); the random numbers
    are drawn for the whole batch, so a row is augmented alike however many processes share it.
    `rows`: a slice or the global indices of the rows.
    """
    b, h, w, _ = images.shape
    n = batch_size or b
    if padding:
        padded = np.pad(images, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
        dy, dx = rng.integers(0, 2 * padding + 1, size=(2, n))[:, rows]
        images = np.stack([padded[i, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(b)])
    if flip:
        flips = (rng.random(n) < 0.5)[rows]
        images = np.where(flips[:, None, None, None], images[:, :, ::-1], images)
    return images
