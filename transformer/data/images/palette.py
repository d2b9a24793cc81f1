"""The palette tokenizer of ImageGPT: each pixel's colour is the id of its nearest of K colours, fitted by
k-means on a sample of the training pixels (Chen et al. 2020 use K = 512 over RGB).

Glossary of shapes: N images, S side, C channels, K colours, L = S x S pixels in raster order.

A run saves its palette beside any tokenizer (`tokenizer_config.json` of kind 'palette' with the
colours in `palette.npy`), and a resumed run, generate and the probes load it from there, so the ids
never change under a checkpoint. Id K is [SOS], the token every image starts with (vocabulary K + 1).
"""

import json
import os

import numpy as np

from transformer.data.text import tokenizers

KIND = "palette"
FILE = "palette.npy"
MOST_FIT_PIXELS = 1_000_000  # k-means sees a fixed sample of at most this many pixels


class PaletteTokenizer:
    """colours uint8 [K, C]: pixels [..., C] -> ids [...] (the nearest colour, squared distance) and back."""

    kind = KIND

    def __init__(self, colours: np.ndarray):
        self.colours = np.asarray(colours, np.uint8)
        self.vocab_size = len(self.colours) + 1

    @property
    def sos_id(self) -> int:
        return len(self.colours)

    @property
    def channels(self) -> int:
        return self.colours.shape[1]

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 pixels [..., C] -> int32 ids [...] of their nearest colours."""
        pixels = np.asarray(pixels)
        if pixels.shape[-1] != self.channels:
            raise ValueError(f"pixels of {pixels.shape[-1]} channels for a palette of {self.channels}")
        flat = pixels.reshape(-1, self.channels).astype(np.float32)  # [P, C]
        colours = self.colours.astype(np.float32)
        ids = np.empty(len(flat), np.int32)
        for start in range(0, len(flat), 65536):  # [chunk, K] distances at a time
            part = flat[start:start + 65536]
            distance = (part ** 2).sum(1, keepdims=True) - 2 * part @ colours.T + (colours ** 2).sum(1)
            ids[start:start + 65536] = distance.argmin(1)
        return ids.reshape(pixels.shape[:-1])

    def decode(self, ids) -> np.ndarray:
        """ids [...] -> uint8 pixels [..., C] ([SOS] and anything out of range read as colour 0)."""
        ids = np.asarray(ids)
        return self.colours[np.where((ids >= 0) & (ids < len(self.colours)), ids, 0)]

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        np.save(os.path.join(directory, FILE), self.colours)
        with open(os.path.join(directory, tokenizers.CONFIG_FILE), "w") as f:
            json.dump({"kind": KIND, "colours": len(self.colours), "channels": self.channels,
                       "specials": {"[SOS]": self.sos_id}}, f, indent=1)

    def special_id(self, name: str) -> int | None:
        return self.sos_id if name in ("[SOS]", "[BOS]") else None


def is_saved(directory: str) -> bool:
    """Whether `directory` holds a saved palette (a run of images)."""
    path = os.path.join(directory, tokenizers.CONFIG_FILE)
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return json.load(f).get("kind") == KIND


def load(directory: str) -> PaletteTokenizer:
    return PaletteTokenizer(np.load(os.path.join(directory, FILE)))


def fit(images: np.ndarray, colours: int, seed: int = 0) -> PaletteTokenizer:
    """A palette of at most `colours` fitted by scikit-learn's MiniBatchKMeans on the pixels of uint8 images
    [N, S, S, C] (a seeded sample of at most MOST_FIT_PIXELS); where they hold no more distinct colours than
    that, the palette is those colours."""
    from sklearn.cluster import MiniBatchKMeans

    pixels = images.reshape(-1, images.shape[-1])  # [P, C]
    rng = np.random.default_rng(seed)
    if len(pixels) > MOST_FIT_PIXELS:
        pixels = pixels[rng.choice(len(pixels), MOST_FIT_PIXELS, replace=False)]
    distinct = np.unique(pixels, axis=0)
    if len(distinct) <= colours:
        return PaletteTokenizer(_by_brightness(distinct))
    kmeans = MiniBatchKMeans(n_clusters=colours, random_state=seed, batch_size=4096, n_init=3, max_iter=100)
    kmeans.fit(pixels.astype(np.float32))
    centres = np.clip(np.round(kmeans.cluster_centers_), 0, 255).astype(np.uint8)
    return PaletteTokenizer(_by_brightness(centres))


def _by_brightness(colours: np.ndarray) -> np.ndarray:
    """Colours [K, C] ordered darkest first (ids then read as a rough brightness order)."""
    return colours[np.argsort(colours.astype(np.int64).sum(1), kind="stable")]


def unigram_entropy(ids: np.ndarray, vocab: int) -> float:
    """Nats per id of the ids' own frequencies: the loss of a model that ignores every neighbour."""
    p = np.bincount(np.asarray(ids).reshape(-1), minlength=vocab) / np.asarray(ids).size
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())
