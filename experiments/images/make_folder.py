"""An image folder of any size from scikit-learn's 1,797 digits, deterministic (seeded).

Image i is digit `rng.integers(1797)` of rng = default_rng([seed, i]), upscaled (np.kron) to
SIZE x SIZE, coloured RGB (digit, 255 - digit, digit // 2, the digit in 0..255), shifted by
np.roll of -3..3 pixels on each axis (the same rng), optionally with Gaussian noise (--noise STD, the
same rng: photo-like JPEG sizes and decode cost), written as DIR/CLASS/NNNNNN.png (or .jpg
with --format jpeg, quality 90) where CLASS is the digit's label and NNNNNN is i. Written by a
pool of 2 processes. `--npz FILE` also writes the same images as x uint8 [N, SIZE, SIZE, 3],
y int64 [N] in the order of the folder's index (class name sorted, then file name sorted).

    python experiments/images/make_folder.py --out /tmp/digits64 --n 50000 --size 64
    python experiments/images/make_folder.py --out /tmp/digits1k --n 1000 --size 64 --npz /tmp/digits1k.npz
    python experiments/images/make_folder.py --out /tmp/digits256 --n 3000 --size 256 --format jpeg
"""

import argparse
import multiprocessing
import os

import numpy as np

_DIGITS = {}


def _digits():
    if not _DIGITS:
        from sklearn.datasets import load_digits
        d = load_digits()
        _DIGITS["x"] = np.round(d.images * (255.0 / 16.0)).astype(np.uint8)  # [1797, 8, 8]
        _DIGITS["y"] = d.target.astype(np.int64)
    return _DIGITS["x"], _DIGITS["y"]


def image(i: int, size: int, seed: int, noise: float = 0.0) -> tuple[np.ndarray, int]:
    """(uint8 [size, size, 3], label) of image i (plus Gaussian noise of std `noise`, clipped)."""
    x, y = _digits()
    rng = np.random.default_rng([seed, i])
    k = int(rng.integers(len(x)))
    gray = np.kron(x[k], np.ones((size // 8, size // 8), np.uint8))  # [size, size]
    rgb = np.stack([gray, 255 - gray, gray // 2], axis=-1)
    dy, dx = rng.integers(-3, 4, size=2)
    rgb = np.roll(rgb, (int(dy), int(dx)), axis=(0, 1))
    if noise:
        rgb = np.clip(rgb + rng.normal(0.0, noise, rgb.shape).round(), 0, 255).astype(np.uint8)
    return rgb, int(y[k])


def file_name(i: int, label: int, fmt: str) -> str:
    return os.path.join(str(label), f"{i:06d}.{'png' if fmt == 'png' else 'jpg'}")


def _write(job) -> list[tuple[int, int]]:
    from PIL import Image
    out, indices, size, seed, fmt, noise = job
    written = []
    for i in indices:
        x, label = image(i, size, seed, noise)
        path = os.path.join(out, file_name(i, label, fmt))
        if fmt == "png":
            Image.fromarray(x).save(path, format="PNG")
        else:
            Image.fromarray(x).save(path, format="JPEG", quality=90)
        written.append((i, label))
    return written


def make(out: str, n: int, size: int = 64, fmt: str = "png", seed: int = 0, npz: str = "",
         processes: int = 2, noise: float = 0.0) -> dict:
    """Writes the folder (and the .npz); returns {'images', 'bytes', 'labels' [N] in file order}."""
    if size % 8:
        raise ValueError(f"--size {size} must be a multiple of 8 (the digits are 8 x 8)")
    for label in range(10):
        os.makedirs(os.path.join(out, str(label)), exist_ok=True)
    chunks = [(out, range(start, min(n, start + 1000)), size, seed, fmt, noise) for start in range(0, n, 1000)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        written = [pair for part in pool.imap(_write, chunks) for pair in part]
    # the folder index's order: class name sorted, then file name sorted (NNNNNN: index order)
    order = sorted(written, key=lambda p: (str(p[1]), file_name(p[0], p[1], fmt)))
    if npz:
        x = np.stack([image(i, size, seed, noise)[0] for i, _ in order])
        np.savez(npz, x=x, y=np.array([label for _, label in order], np.int64))
    total = sum(e.stat().st_size for label in range(10) for e in os.scandir(os.path.join(out, str(label))))
    return {"images": n, "bytes": total, "decoded_bytes": n * size * size * 3,
            "labels": [label for _, label in order]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--format", choices=["png", "jpeg"], default="png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--npz", default="")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="std of Gaussian pixel noise (makes JPEGs photo-like in size and decode cost)")
    args = parser.parse_args()
    r = make(args.out, args.n, args.size, args.format, args.seed, args.npz, noise=args.noise)
    print(f"{args.out}: {r['images']:,} images, {r['bytes'] / 1e6:.1f} MB on disk, "
          f"{r['decoded_bytes'] / 1e6:.1f} MB decoded" + (f"; {args.npz}" if args.npz else ""))


if __name__ == "__main__":
    main()
