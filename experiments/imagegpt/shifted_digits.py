"""Writes the shifted digits: each 8 x 8 digit pasted at a random place of a 12 x 12 black canvas, so that a
class is no longer a fixed set of pixels (where a logistic regression on raw pixels is weak and
position-averaged features are not):

  python experiments/imagegpt/shifted_digits.py /tmp/shifted_digits.npz

The digits' own held-out split (transformer/data/images/sources.load_digits) stays held out: `x`, `y` hold
each train digit at 3 places, `x_test`, `y_test` each held-out digit at one.
"""

import sys

import numpy as np

from transformer.data.images import sources

CANVAS, COPIES, SEED = 12, 3, 0


def paste(images: np.ndarray, copies: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [N, 8, 8, 1] -> [N x copies, CANVAS, CANVAS], each at a uniformly drawn offset."""
    out = np.zeros((len(images) * copies, CANVAS, CANVAS), np.uint8)
    for k, image in enumerate(np.repeat(images[..., 0], copies, axis=0)):
        top, left = rng.integers(0, CANVAS - 8 + 1, 2)
        out[k, top:top + 8, left:left + 8] = image
    return out


def main(path: str) -> None:
    rng = np.random.default_rng(SEED)
    (x, y), (x_test, y_test) = (sources.load_digits(0.2)[s] for s in ("train", "test"))
    np.savez(path, x=paste(x, COPIES, rng), y=np.repeat(y, COPIES), x_test=paste(x_test, 1, rng), y_test=y_test)
    print(f"{path}: {len(x) * COPIES} train and {len(x_test)} held-out {CANVAS} x {CANVAS} images")


if __name__ == "__main__":
    main(sys.argv[1])
