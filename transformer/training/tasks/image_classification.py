"""Image classification: cross-entropy on labelled images, top-1 and top-5 accuracy on the test split.

Glossary of shapes: B batch, H/W height/width (the model's image size), C channels, N classes.
A batch is {'images': uint8 [B, H, W, C], 'labels': int32 [B], 'replaced': float32 [B]}
(`data/images/batches.py`); eval batches add 'weights' [B] (0 on padding). The step normalises
the images on the device by the run's statistics (fixed, `config.data.mean`/`std`, or
sampled once and saved in WORKDIR/images/statistics.json), then mixes pairs of the batch
when `config.data.augment.mixup_alpha` or `cutmix_alpha` is set: row i with row B - 1 - i,
by a weight lam ~ Beta(alpha, alpha) shared by the batch (mixup: a blend of the images;
cutmix: a box of area 1 - lam pasted from the partner, lam then the area kept), one of the
two picked per step with probability `mix_switch` for cutmix where both are set, the
targets mixed alike (soft targets; label smoothing on top). The draws come from the step's
key: a pure function of (seed, step), as the rest of the batch.

Images that could not be read (and were replaced) are counted: `train/replaced_images_since_last_log`
in the batches of the steps since the last log (a count, summed: `metrics.over_steps`),
`eval/replaced_images` over the test split.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from transformer import rundir
from transformer.data.images import batches, device_views, host_views
from transformer.data.images import sources as image_sources
from transformer.data.images.splits import ArraySplit, FileSplit
from transformer.training import losses, shapes

LARGEST_SIDE = 224  # ImageNet's: larger images are viewed at this side
MOST_PATCHES = 24   # patches along a side
COLOUR = {1: "grayscale", 3: "RGB"}


def image_side(typical: int, patch: int) -> int:
    """The side images of a typical (shorter) side `typical` are viewed at: the nearest multiple of `patch`
    (halves up), at least one patch, at most LARGEST_SIDE and MOST_PATCHES patches."""
    patch = max(patch, 1)
    most = min(LARGEST_SIDE, MOST_PATCHES * patch) // patch * patch
    return max(patch, min(most, patch * int(typical / patch + 0.5)))




def from_data(config) -> list[str]:
    """model.num_classes, channels and image_size from what config.data.source holds (`image_sources.describe`:
    class folders, labels, a sample of image headers)."""
    m, source = config.model, config.data.source
    holds = image_sources.describe(config.data)
    sides = sorted(min(side) for side in holds.sides)
    typical = int(np.median(sides))
    shape = (f"{holds.sides[0][0]} x {holds.sides[0][1]}" if len(set(holds.sides)) == 1
             else f"{sides[0]}..{sides[-1]} px on the shorter side (median {typical}) of {len(sides)} sampled")
    says = [f"data: {source}: {holds.classes:,} classes, {COLOUR.get(holds.channels, f'{holds.channels}-channel')} "
            f"{shape} images"]
    taken, how = {}, ""
    if not shapes.take(config, taken, "model.num_classes", holds.classes):
        if m.num_classes < holds.classes:
            raise ValueError(f"config.model.num_classes={m.num_classes} but {source} holds {holds.classes} classes: "
                             "raise it, or leave it out (the data's)")
        if m.num_classes > holds.classes:
            says.append(f"config.model.num_classes={m.num_classes}: {source} holds {holds.classes}; the head's other "
                        f"{m.num_classes - holds.classes} outputs are never a target")
    if not shapes.take(config, taken, "model.channels", holds.channels) and m.channels != holds.channels:
        if not holds.files or m.channels not in COLOUR:
            raise ValueError(f"config.model.channels={m.channels} but {source} holds {holds.channels}-channel images"
                             + (": files are read as 1 (grayscale) or 3 (RGB)" if holds.files else ""))
        says.append(f"config.model.channels={m.channels}: {source}'s images are {COLOUR[holds.channels]}, read as "
                    f"{COLOUR[m.channels]}")
    if shapes.take(config, taken, "model.image_size", image_side(typical, m.patch_size)):
        how = (f" (image_size: the images' median side, {typical}, to the nearest multiple of patch_size="
               f"{m.patch_size}; at most {LARGEST_SIDE} and {MOST_PATCHES} patches a side)")
    elif not typical / 2 <= m.image_size <= 2 * typical:
        says.append(f"config.model.image_size={m.image_size}: {source}'s images are typically {typical} px a side, "
                    f"viewed at {m.image_size} x {m.image_size}")
    return shapes.said(says, taken, how)


def check(config) -> None:
    d, a = config.data, config.data.augment
    if not 0 <= config.train.label_smoothing < 1:
        raise ValueError(f"config.train.label_smoothing={config.train.label_smoothing} must be in [0, 1)")
    if not 0 < d.crop_fraction <= 1:
        raise ValueError(f"config.data.crop_fraction={d.crop_fraction} must be in (0, 1]")
    for key in ("mixup_alpha", "cutmix_alpha", "rand_augment_ops", "crop_padding"):
        if a[key] < 0:
            raise ValueError(f"config.data.augment.{key}={a[key]} must be at least 0")
    if not (0 < a.scale[0] <= a.scale[1] <= 1 and 0 < a.ratio[0] <= a.ratio[1]):
        raise ValueError(f"config.data.augment.scale={tuple(a.scale)} must be 0 < lo <= hi <= 1 and "
                         f"ratio={tuple(a.ratio)} 0 < lo <= hi")
    if not 0 <= a.rand_augment_magnitude <= 10:
        raise ValueError(f"config.data.augment.rand_augment_magnitude={a.rand_augment_magnitude} must be in [0, 10]")
    for key in ("mean", "std"):
        if len(d[key]) not in (0, config.model.channels):
            raise ValueError(f"config.data.{key}={tuple(d[key])} needs one value per channel "
                             f"(config.model.channels={config.model.channels}), or () to sample them")
    if len(d.mean) != len(d.std):
        raise ValueError("config.data.mean and config.data.std are given together (or neither: sampled)")
    if any(v <= 0 for v in d.std):
        raise ValueError(f"config.data.std={tuple(d.std)} must be positive")
    if not 0 <= a.mix_switch <= 1:
        raise ValueError(f"config.data.augment.mix_switch={a.mix_switch} must be in [0, 1]")
    if a.get("views", "auto") not in VIEWS:
        raise ValueError(f"config.data.augment.views={a.views!r}: choose one of {', '.join(VIEWS)}")


VIEWS = ("auto", "host", "device")


def on_device(config, splits: dict) -> bool:
    """Whether the train and eval views are made on the device (`device_views`): in-memory uint8 images
    with config.data.augment.views 'device', or 'auto' where JAX computes on an accelerator (on a CPU,
    Pillow in worker processes is the faster of the two)."""
    train, views = splits["train"], config.data.augment.get("views", "auto")
    wanted = views == "device" or (views == "auto" and jax.default_backend() != "cpu")
    return wanted and isinstance(train, ArraySplit) and train.x.dtype == np.uint8


def workers(config, splits: dict) -> int:
    """config.data.workers, where -1 (auto) is the CPUs (at most 32) where the host makes the views (files,
    in-memory images with augmentations on the host), else 0 (the host only gathers images)."""
    if config.data.workers >= 0:
        return config.data.workers
    recipe = host_views.Recipe.of(config)
    host_work = isinstance(splits["train"], FileSplit) or (not on_device(config, splits) and (
        recipe.uses_pil or recipe.flip or recipe.crop_padding))
    return min(32, os.cpu_count() or 1) if host_work else 0


class ImageClassificationTask:
    item_name = "images"

    def __init__(self, config, workdir: str, rows: np.ndarray):
        self.config, d = config, config.data
        show = jax.process_index() == 0
        splits = image_sources.load(d, workdir, show, rundir.read_labels(workdir))  # a converted run's, the
        # run's that evaluate scores on another folder, or its own index's
        self.recipe = host_views.Recipe.of(config)
        _check_sources(splits, self.recipe, config)
        self.on_device = on_device(config, splits)
        self.data = batches.ImageData(splits, self.recipe, d.batch_size, config.train.seed, rows,
                                      workers(config, splits), device_views=self.on_device)
        self.mean, self.std = self.data.run_statistics(d, workdir, show, save=show)
        test = np.asarray(splits["test"].labels)
        self.majority_accuracy = float(np.mean(test == np.bincount(np.asarray(splits["train"].labels)).argmax()))
        if show:
            where = "on the device" if self.on_device else f"by {self.data.workers or 'no'} worker processes"
            print(f"images: {len(splits['train']):,} train, {len(test):,} test, viewed as {self.data.image_shape} "
                  f"{where}; mean {np.round(self.mean, 2).tolist()}, std "
                  f"{np.round(self.std, 2).tolist()}; majority-class test accuracy {self.majority_accuracy:.4f}",
                  file=sys.stderr)
        self.items_per_step = d.batch_size

    def init_inputs(self):
        return (jnp.zeros((1, *self.data.image_shape), jnp.float32),)

    def train_batch(self, step: int) -> dict:
        return self.data.train_batch(step)

    def eval_batches(self):
        return self.data.eval_batches()

    def inputs(self, batch: dict) -> jax.Array:
        """The batch's images as the model reads them: float32, normalised per channel; views made here
        where the batch brings the images as stored (`device_views`: train views of its examples, else
        eval views)."""
        x = batch["images"]
        if "example" in batch:
            x = device_views.train_views(x, batch["example"], self.recipe, self.config.train.seed)
        elif self.on_device:
            x = device_views.eval_views(x, self.recipe)
        return (x.astype(jnp.float32) - self.mean) / self.std

    def loss(self, model, params, batch, rng):
        a = self.config.data.augment
        x, labels = self.inputs(batch), batch["labels"]
        num_classes = self.config.model.num_classes
        targets = jax.nn.one_hot(labels, num_classes)
        if a.mixup_alpha or a.cutmix_alpha:
            rng, mix_rng = jax.random.split(rng)
            x, targets = mix(x, targets, mix_rng, a.mixup_alpha, a.cutmix_alpha, a.mix_switch)
        logits = model.apply({"params": params}, x, deterministic=False, rngs={"dropout": rng})
        loss = losses.mean(losses.cross_entropy(logits, targets, smoothing=self.config.train.label_smoothing))
        accuracy = (logits.argmax(-1) == labels).mean()
        replaced = batch["replaced"].mean() * self.config.data.batch_size  # the step's count, microbatched or not
        return loss, {"loss": loss, "accuracy": accuracy, "replaced_images_since_last_log": replaced}

    def eval_outputs(self, model, params, batch) -> dict:
        logits = model.apply({"params": params}, self.inputs(batch))  # [B, N]
        w = batch["weights"]
        top5 = jax.lax.top_k(logits, min(5, logits.shape[-1]))[1]  # [B, 5]
        correct = (top5[:, 0] == batch["labels"]).astype(jnp.float32)
        correct5 = (top5 == batch["labels"][:, None]).any(-1).astype(jnp.float32)
        loss_sum, count = losses.cross_entropy(logits, jax.nn.one_hot(batch["labels"], logits.shape[-1]), w)
        return {"loss_sum": loss_sum, "correct": (correct * w).sum(), "correct5": (correct5 * w).sum(),
                "count": count, "replaced": (batch["replaced"] * w).sum()}

    def eval_metrics(self, outputs: list[dict]) -> dict:
        total = {k: sum(float(o[k]) for o in outputs) for k in outputs[0]}
        return {"eval/loss": total["loss_sum"] / total["count"], "eval/accuracy": total["correct"] / total["count"],
                "eval/top5_accuracy": total["correct5"] / total["count"],
                "eval/majority_accuracy": self.majority_accuracy, "eval/replaced_images": total["replaced"]}

    def loss_weights(self, batch) -> dict:
        return {"loss": batch["labels"].size}

    def report(self, model, params, step: int) -> list[str]:
        return []


def mix(x: jax.Array, targets: jax.Array, rng: jax.Array, mixup_alpha: float, cutmix_alpha: float,
        switch: float) -> tuple[jax.Array, jax.Array]:
    """Mixup or cutmix of row i with row B - 1 - i (see the module docstring): x [B, H, W, C],
    targets [B, N] -> the mixed (x, targets)."""
    pick, draw, at_y, at_x = jax.random.split(rng, 4)
    cut = jax.random.bernoulli(pick, switch) if mixup_alpha and cutmix_alpha else jnp.asarray(bool(cutmix_alpha))
    lam = jax.random.beta(draw, jnp.where(cut, cutmix_alpha or 1.0, mixup_alpha or 1.0),
                          jnp.where(cut, cutmix_alpha or 1.0, mixup_alpha or 1.0))
    _, h, w, _ = x.shape
    partner = x[::-1]
    side = jnp.sqrt(1.0 - lam)
    ch, cw = jnp.round(side * h).astype(jnp.int32), jnp.round(side * w).astype(jnp.int32)
    cy, cx = jax.random.randint(at_y, (), 0, h), jax.random.randint(at_x, (), 0, w)
    y0, y1 = jnp.clip(cy - ch // 2, 0, h), jnp.clip(cy + ch - ch // 2, 0, h)
    x0, x1 = jnp.clip(cx - cw // 2, 0, w), jnp.clip(cx + cw - cw // 2, 0, w)
    rows, cols = jnp.arange(h)[:, None], jnp.arange(w)[None, :]
    box = ((rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1))[None, :, :, None]
    kept = jnp.where(cut, 1.0 - box.sum() / (h * w), lam)
    mixed = jnp.where(cut, jnp.where(box, partner, x), lam * x + (1.0 - lam) * partner)
    return mixed, kept * targets + (1.0 - kept) * targets[::-1]


def _check_sources(splits: dict, recipe: host_views.Recipe, config) -> None:
    """In-memory images fit config.model (files are converted and resized); labels fit num_classes."""
    m, source = config.model, config.data.source
    for split in splits.values():
        if isinstance(split, ArraySplit):
            h, w, c = split.x.shape[1:]
            if c != m.channels:
                raise ValueError(f"config.data.source={source!r} has {c} channels but config.model.channels="
                                 f"{m.channels}")
            if (h, w) != (m.image_size, m.image_size) and split.x.dtype != np.uint8:
                raise ValueError(f"config.data.source={source!r} has {h} x {w} images of {split.x.dtype} but "
                                 f"config.model.image_size={m.image_size} (only uint8 images are resized)")
            if recipe.uses_pil and split.x.dtype != np.uint8:
                raise ValueError(f"config.data.source={source!r} holds {split.x.dtype} images: random_resized_crop, "
                                 "rand_augment_ops and crop_fraction < 1 (config.data) need uint8")
    labels = np.concatenate([np.asarray(s.labels) for s in splits.values()])
    if labels.min() < 0 or labels.max() >= m.num_classes:
        raise ValueError(f"config.data.source={source!r} has labels {labels.min()}..{labels.max()} but "
                         f"config.model.num_classes={m.num_classes}")


def build(config, workdir: str, rows: np.ndarray, start_step: int) -> ImageClassificationTask:
    return ImageClassificationTask(config, workdir, rows)
