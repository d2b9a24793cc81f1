"""ImageGPT (Chen et al. 2020): a GPT trained to predict each pixel's palette id from the pixels above and
to its left, where `config.data.source` names images (`pixels.is_image_source`); the lm task hands its
work here.

Glossary of shapes: B batch (this process's rows), S side, L = S x S pixels, K palette colours.

A batch is {'tokens': int32 [B, L + 1]}: [SOS] and an image's ids (data/images/pixels.py), so the lm
task's loss is the mean over every pixel of its cross entropy in nats (`eval/loss`, nats per pixel;
`eval/bits_per_pixel` in bits). `eval/unigram_entropy` is the train pixels' own entropy over the
palette: the loss of a model that sees no neighbour, which a run must fall well below. Example g = step
x B + row of the train stream is image `order.epochs(g, N, (seed,))`; eval reads the held-out split's
first whole batches. After an eval with `config.train.sample_tokens` > 0 the run writes the upper halves
of a few held-out images completed (WORKDIR/samples/completions-STEP.png).
"""

import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from transformer.data.images import palette, pixels
from transformer.data.text import order
from transformer.training import tasks
from transformer.training.tasks import lm

SAMPLE_IMAGES = 8


def pixel_count(config) -> int:
    return config.data.image_side ** 2


def check(config) -> None:
    d = config.data
    if d.image_side < 1 or d.palette_size < 2:
        raise ValueError(f"config.data.image_side={d.image_side} and palette_size={d.palette_size}: a side of at "
                         "least 1 and a palette of at least 2 colours")
    if d.seq_len != pixel_count(config):  # a run's own config.json, edited (a launch takes it from the side)
        raise ValueError(f"config.data.seq_len={d.seq_len} but config.data.image_side={d.image_side} gives "
                         f"{pixel_count(config)} pixels an image: set config.data.seq_len={pixel_count(config)}")
    tasks.check_lengths(config, "seq_len")
    if d.document_mask:
        raise ValueError("config.data.document_mask: each row is one image; set it to False")


def from_data(config) -> list[str]:
    """Fills in data.tokenizer ('palette') and model.vocab_size (palette_size + [SOS]) where the config
    leaves them to the data, and data.seq_len (model.max_len where it is shorter) from data.image_side: a row
    is an image; the lines that say the palette, side and sequence length, and what was set."""
    d, m = config.data, config.model
    colour = {1: "grayscale"}.get(pixels.channels(d), "RGB")
    taken = []
    if d.tokenizer == "":
        d.tokenizer = palette.KIND
        taken.append(f"data.tokenizer={palette.KIND!r}")
    if d.tokenizer != palette.KIND:
        raise ValueError(f"config.data.tokenizer={d.tokenizer!r}: images are read by their palette; leave it out "
                         f"or set it to {palette.KIND!r}")
    pixel_keys = []
    if d.seq_len != pixel_count(config):
        d.seq_len = pixel_count(config)
        pixel_keys.append(f"data.seq_len={d.seq_len}")
    if m.max_len < pixel_count(config):
        m.max_len = pixel_count(config)
        pixel_keys.append(f"model.max_len={m.max_len}")
    ids = d.palette_size + 1
    if m.vocab_size == 0:
        m.vocab_size = ids
        taken.append(f"model.vocab_size={ids}")
    elif m.vocab_size < ids:
        raise ValueError(f"config.model.vocab_size={m.vocab_size} is smaller than the palette's {ids} ids "
                         f"(palette_size + [SOS]): raise it, or leave it out (the data's)")
    lines = [f"data: {d.source}: {colour} images viewed at {d.image_side} x {d.image_side}, each pixel one of a "
             f"palette of at most {d.palette_size} colours (k-means on the train pixels) + [SOS]: sequences of "
             f"{pixel_count(config)} pixels in raster order"]
    if pixel_keys:
        lines.append(f"from data.image_side={d.image_side}: {', '.join(pixel_keys)} (a row is one image's pixels)")
    return lines + ([f"from the data: {', '.join(taken)}"] if taken else [])


class ImageLMTask(lm.LMTask):
    """The lm task's loss and eval sums over rows of images instead of windows of text."""

    item_name = "tokens"

    def __init__(self, config, workdir: str, rows: np.ndarray, start_step: int):
        self.config, self.workdir, self.rows = config, workdir, rows
        show = jax.process_index() == 0
        views = pixels.open_views(config, workdir, show)
        self.tokenizer = pixels.run_palette(config, workdir, views["train"][0], show)
        self.train = pixels.sequences(self.tokenizer, views["train"][0])  # [N, L + 1]
        test = pixels.sequences(self.tokenizer, views["test"][0])
        self.samples = views["test"][0][pixels.spread(views["test"][1], SAMPLE_IMAGES)]
        d = config.data
        self.items_per_step = d.batch_size * d.seq_len
        count = min(d.eval_batches, len(test) // d.batch_size)
        if count < 1 and d.eval_batches:
            raise ValueError(f"the held-out split has {len(test)} images, too few for one batch of {d.batch_size}: "
                             "raise config.data.eval_fraction or lower config.data.batch_size")
        self.eval = [{"tokens": b[rows]} for b in test[:count * d.batch_size].reshape(count, d.batch_size, -1)]
        self.entropy = palette.unigram_entropy(self.train[:, 1:], self.tokenizer.vocab_size)
        if show:
            print(f"data: {len(self.train):,} train and {len(test):,} held-out images; the train pixels' unigram "
                  f"entropy over the palette is {self.entropy:.3f} nats per pixel (eval/loss must fall below it)",
                  file=sys.stderr)

    def train_batch(self, step: int) -> dict:
        b = self.config.data.batch_size
        g = step * b + np.asarray(self.rows, np.int64)
        return {"tokens": self.train[order.epochs(g, len(self.train), (self.config.train.seed,))]}

    def eval_batches(self) -> list[dict]:
        return self.eval

    def init_inputs(self):
        return (jnp.zeros((1, self.config.data.seq_len), jnp.int32),)

    def eval_metrics(self, outputs: list[dict]) -> dict:
        loss = sum(float(o["loss_sum"]) for o in outputs) / sum(float(o["count"]) for o in outputs)
        return {"eval/loss": loss, "eval/bits_per_pixel": loss / math.log(2), "eval/unigram_entropy": self.entropy}

    def report(self, model, params, step: int) -> list[str]:
        if not self.config.train.sample_tokens:
            return []
        from transformer.inference import images as image_completion

        out = os.path.join(self.workdir, "samples", f"completions-{step}.png")
        completed = image_completion.complete(model, params, self.tokenizer, self.samples, samples=2, seed=step)
        image_completion.save_grid(out, self.samples, completed, f"held-out images completed at step {step}")
        return [f"--- completions at step {step}: {out}"]


def build(config, workdir: str, rows: np.ndarray, start_step: int) -> ImageLMTask:
    return ImageLMTask(config, workdir, rows, start_step)
