"""Images as sequences of palette ids for a GPT (ImageGPT): the image sources of a ViT (sources.py: the
digits, IDX, .npz, folders of class folders with their splits and unreadable files replaced alike),
viewed at S x S (the eval view: the shorter side resized, the centre cropped), read in raster order.

Glossary of shapes: N images of a split, S side (config.data.image_side), C channels, L = S x S
pixels, K palette colours.

A GPT run reads images where `config.data.source` names an image source (`is_image_source`). The
views are made once into WORKDIR/pixels/{train,test}.npz (uint8 images [N, S, S, C] and labels [N]) and
read back by a resumed run, generate and the linear probe; the palette is fitted once on the train
split's pixels and saved as the run's tokenizer (palette.py). A sequence is [SOS] + the L ids.
"""

import os
import sys

import ml_collections
import numpy as np

from transformer import console
from transformer.data.images import batches, folders, host_views, palette, sources, splits
from transformer.data.text import lm_streams

OUT_DIR = "pixels"
CHUNK = 512  # images viewed between progress updates


def is_image_source(source: str) -> bool:
    """Whether `config.data.source` names images (the digits, an .npz, a folder of IDX files or of class
    folders of image files) rather than text or token stores."""
    path = os.path.expanduser(source)
    if source == "digits" or path.endswith(".npz"):
        return True
    if not os.path.isdir(path) or lm_streams.is_store(path):
        return False
    if not folders.is_folder_of_files(path):
        return True  # MNIST-family IDX files
    try:
        folders.sample(ml_collections.ConfigDict({"source": source}), count=1)
    except (ValueError, OSError):
        return False
    return True


def image_config(data_config) -> ml_collections.ConfigDict:
    """The keys `sources` reads, from a GPT's config.data (its eval_fraction is the held-out share)."""
    return ml_collections.ConfigDict({"source": data_config.source, "test_fraction": data_config.eval_fraction,
                                      "val_labels": ""})


def channels(data_config) -> int:
    """1 (grayscale) or the source's channels (3 where a sampled file has colour)."""
    return sources.describe(image_config(data_config)).channels


def view_split(split, side: int, channels_: int, name: str, show: bool) -> tuple[np.ndarray, int]:
    """(uint8 views [N, S, S, C] of every image of `split`, how many unreadable ones were replaced)."""
    recipe = host_views.Recipe(side, channels_)
    views, replaced = [], 0
    starts = range(0, len(split), CHUNK)
    for start in console.progress(starts, desc=f"viewing the {name} images at {side} x {side}", disable=not show,
                              leave=False):
        x, swapped, notes = batches.make_views(split, recipe, range(start, min(start + CHUNK, len(split))), None)
        if x.dtype != np.uint8:
            raise ValueError(f"{split.name(start)}: images of {x.dtype}; a palette reads uint8 pixels (0..255)")
        views.append(x)
        replaced += int(swapped.sum())
        for image, why in notes:
            print(f"warning: {image} cannot be read ({why}); the next readable image stands in", file=sys.stderr)
    return np.concatenate(views), replaced


def _save(path: str, **arrays) -> None:
    with open(path + ".tmp", "wb") as f:
        np.savez(f, **arrays)
    os.replace(path + ".tmp", path)


def open_views(config, workdir: str, show: bool = False) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{'train', 'test': (uint8 images [N, S, S, C], int64 labels [N])}: made into WORKDIR/pixels/ the first
    time (the source's splits viewed at config.data.image_side), read back after."""
    d = config.data
    out = os.path.join(workdir, OUT_DIR)
    paths = {s: os.path.join(out, f"{s}.npz") for s in ("train", "test")}
    if not all(os.path.isfile(p) for p in paths.values()):
        image_data = image_config(d)
        splits = sources.load(image_data, workdir, show)
        c = channels(d)
        os.makedirs(out, exist_ok=True)
        for name, split in splits.items():
            x, replaced = view_split(split, d.image_side, c, name, show)
            if replaced and show:
                print(f"data: {replaced} unreadable {name} image(s) replaced by readable ones", file=sys.stderr)
            _save(paths[name], images=x, labels=np.asarray(split.labels, np.int64))
    views = {}
    for name, path in paths.items():
        with np.load(path) as f:
            views[name] = (f["images"], f["labels"])
    side = views["train"][0].shape[1]
    if side != d.image_side:
        raise ValueError(f"config.data.image_side={d.image_side} but {out} holds images viewed at {side}: "
                         "a new --workdir views them again")
    return views


def run_palette(config, workdir: str, train_images: np.ndarray, show: bool = False) -> palette.PaletteTokenizer:
    """The run's palette: the one saved in `workdir`, else fitted on the train images and saved there (fewer
    colours than config.data.palette_size where they hold fewer, said where `show`)."""
    from transformer.data.text import tokenizers

    size = config.data.palette_size
    if palette.is_saved(workdir):
        tokenizer = palette.load(workdir)
        if len(tokenizer.colours) > size:
            raise ValueError(f"{workdir} holds a palette of {len(tokenizer.colours)} colours, more than "
                             f"config.data.palette_size={size}: start a new --workdir")
        return tokenizer
    if os.path.isfile(os.path.join(workdir, tokenizers.CONFIG_FILE)):
        raise ValueError(f"{workdir} holds a {tokenizers.load_tokenizer(workdir).kind} tokenizer, not a palette: "
                         "start a new --workdir")
    tokenizer = palette.fit(train_images, size, config.train.seed)
    if len(tokenizer.colours) < size and show:
        print(f"data: the train images of {config.data.source} hold {len(tokenizer.colours)} distinct colours, "
              f"fewer than config.data.palette_size={size}: the palette is those {len(tokenizer.colours)} (ids "
              f"{len(tokenizer.colours) + 1}..{size} stay unused; data.palette_size={len(tokenizer.colours)} "
              "makes the vocabulary fit)", file=sys.stderr)
    tokenizer.save(workdir)
    return tokenizer


def sequences(tokenizer: palette.PaletteTokenizer, images: np.ndarray) -> np.ndarray:
    """uint8 images [N, S, S, C] -> int32 [N, L + 1]: [SOS] then the pixels' ids in raster order."""
    ids = tokenizer.encode(images).reshape(len(images), -1)  # [N, L]
    return np.concatenate([np.full((len(images), 1), tokenizer.sos_id, np.int32), ids], 1)


def read_images(paths: list[str], side: int, channels_: int) -> np.ndarray:
    """Image files viewed as a run's data were (the shorter side resized to S, the centre cropped) -> uint8
    [N, S, S, C]; an unreadable one fails naming it."""
    recipe, views = host_views.Recipe(side, channels_), []
    for path in paths:
        try:
            views.append(host_views.eval_view(splits.read_file(path), recipe))
        except batches.UNREADABLE as e:
            raise ValueError(f"{path}: cannot read image: {e}") from None
        if views[-1].dtype != np.uint8:
            raise ValueError(f"{path}: an image of {views[-1].dtype}; a palette reads uint8 pixels (0..255)")
    return np.stack(views)


def spread(labels: np.ndarray, count: int) -> np.ndarray:
    """Indices of `count` images, the first of each class before the second of any: a sample that shows
    every class."""
    labels = np.asarray(labels)
    rank = np.zeros(len(labels), np.int64)  # how many earlier images share each one's class
    for label in np.unique(labels):
        at = labels == label
        rank[at] = np.arange(at.sum())
    return np.lexsort((np.arange(len(labels)), rank))[:count]
