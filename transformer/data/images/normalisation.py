"""The per-channel statistics a run normalises its images by, and the normalisation.

Glossary of shapes: n images, H/W height/width, C channels.

Pixels are normalised on the device by per-channel statistics: fixed ones (`config.data.mean`,
`std`) or those of a fixed sample of the train split (`statistics_sample` images, all of a
small split), saved in WORKDIR/images/statistics.json and reused by a resumed run and the
probes (`batches.ImageData.run_statistics` decides which).
"""

import json
import os

import numpy as np

from transformer.data.images.folders import INDEX_DIR, save_json
from transformer.data.images.splits import SPLIT_SEED


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


def recorded_statistics(data_config, workdir: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The (mean [C], std [C]) the run in `workdir` normalises by: fixed (its config.data.mean, std),
    else saved, else None (a run that reads no images, or has not computed them yet)."""
    d = data_config or {}
    if len(d.get("mean", ())):
        return np.asarray(d["mean"], np.float32), np.asarray(d["std"], np.float32)
    return saved_statistics(workdir)


def save_statistics(workdir: str, mean: np.ndarray, std: np.ndarray, how: str) -> None:
    os.makedirs(os.path.join(workdir, INDEX_DIR), exist_ok=True)
    save_json(os.path.join(workdir, INDEX_DIR, STATISTICS),
               {"mean": [float(v) for v in mean], "std": [float(v) for v in std], "from": how})


def normalise(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Images [..., H, W, C] as the model reads them: float32, each channel less its mean over its std
    (the training step does the same on the device, to the uint8 images of a batch)."""
    return (x.astype(np.float32) - mean) / std
