"""What one image becomes on its way to a batch: the train views (the ViT/DeiT recipe) and the eval view.

Glossary of shapes: S the model's image size, C channels; an image is uint8 [H, W, C] (or a
PIL image, as a file decodes). Everything here is numpy and Pillow: it runs in the data
worker processes, which must not import jax. Mixup and cutmix mix pairs of a batch and
run on the device (`training/tasks/image_classification.py`).

train view, in this order, each from `config.data.augment` (all off by default):
  random_resized_crop   a crop of `scale` of the area and aspect `ratio` (log-uniform),
                        resized to S x S (torchvision's RandomResizedCrop: 10 tries, then
                        the centre); off: the eval view
  flip                  horizontal, with probability 1/2
  rand_augment_ops      RandAugment (Cubuk et al. 2020): that many ops, each drawn from
                        RAND_AUGMENT (torchvision's list) at `rand_augment_magnitude` of 10
                        on timm's scales (shear 0.3, translate 0.45 of the side, rotate 30
                        degrees, enhancements 1 +- 0.9, posterize to 4 bits, solarize from
                        0), signs random; geometric ops fill with grey (128)
  crop_padding          a random S x S crop of the image padded by that many zeros (small
                        images: CIFAR's recipe)
eval view: the shorter side resized to S / crop_fraction, the centre S x S cropped (at
crop_fraction 1 a square image is only resized; one of size S is untouched).

The randomness of a view is the generator it is given: the caller seeds it with (seed, step,
example), so a batch is a pure function of its step.
"""

import dataclasses
import math

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

FILL = 128


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The transforms of one run (picklable: it travels to the workers)."""

    image_size: int
    channels: int
    crop_fraction: float = 1.0
    random_resized_crop: bool = False
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = False
    rand_augment_ops: int = 0
    rand_augment_magnitude: float = 9.0
    crop_padding: int = 0

    @classmethod
    def of(cls, config) -> "Recipe":
        """From a run's config (config.model.image_size, channels; config.data.crop_fraction, augment; a run
        saved before these keys existed gets the defaults)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        given = {k: tuple(v) if isinstance(v, (list, tuple)) else v
                 for k, v in dict(config.data.get("augment") or {}).items() if k in fields}
        return cls(config.model.image_size, config.model.channels, config.data.get("crop_fraction", 1.0), **given)

    @property
    def uses_pil(self) -> bool:
        """Whether the train view needs Pillow's operations (so uint8 images)."""
        return self.random_resized_crop or self.rand_augment_ops > 0 or self.crop_fraction < 1


def as_pil(image: np.ndarray | Image.Image, channels: int) -> Image.Image:
    """A uint8 [H, W, C] array or a decoded file -> a PIL image in mode L (C = 1) or RGB (C = 3)."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise ValueError(f"resizing, cropping and RandAugment need uint8 images, got {image.dtype}")
        image = Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)
    return image.convert("L" if channels == 1 else "RGB")


def as_array(image: Image.Image | np.ndarray) -> np.ndarray:
    x = np.asarray(image)
    return x[..., None] if x.ndim == 2 else x


def eval_view(image, recipe: Recipe) -> np.ndarray:
    """The shorter side resized to S / crop_fraction, the centre S x S -> uint8 [S, S, C]."""
    s = recipe.image_size
    if isinstance(image, np.ndarray) and image.shape[:2] == (s, s) and recipe.crop_fraction == 1:
        return image
    image = as_pil(image, recipe.channels)
    w, h = image.size
    short = math.floor(s / recipe.crop_fraction)
    scale = short / min(w, h)
    rw, rh = max(s, round(w * scale)), max(s, round(h * scale))
    if (rw, rh) != (w, h):
        image = image.resize((rw, rh), Image.BILINEAR)
    left, top = (rw - s) // 2, (rh - s) // 2
    return as_array(image.crop((left, top, left + s, top + s)))


def crop_box(width: int, height: int, scale, ratio, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """RandomResizedCrop's (left, top, w, h): up to 10 draws of area and log-uniform aspect, else the
    centre crop at the nearest allowed aspect."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def _signed(x: float, rng: np.random.Generator) -> float:
    return x if rng.random() < 0.5 else -x


def _affine(image: Image.Image, matrix) -> Image.Image:
    return image.transform(image.size, Image.AFFINE, matrix, Image.NEAREST, fillcolor=_fill(image))


def _fill(image: Image.Image):
    return FILL if image.mode == "L" else (FILL,) * 3


def _enhance(kind):
    return lambda image, m, rng: kind(image).enhance(1 + _signed(0.9 * m, rng))


# op(image, magnitude in [0, 1], rng) -> image
RAND_AUGMENT = {
    "identity": lambda image, m, rng: image,
    "shear_x": lambda image, m, rng: _affine(image, (1, _signed(0.3 * m, rng), 0, 0, 1, 0)),
    "shear_y": lambda image, m, rng: _affine(image, (1, 0, 0, _signed(0.3 * m, rng), 1, 0)),
    "translate_x": lambda image, m, rng: _affine(image, (1, 0, _signed(0.45 * m * image.size[0], rng), 0, 1, 0)),
    "translate_y": lambda image, m, rng: _affine(image, (1, 0, 0, 0, 1, _signed(0.45 * m * image.size[1], rng))),
    "rotate": lambda image, m, rng: image.rotate(_signed(30 * m, rng), Image.NEAREST, fillcolor=_fill(image)),
    "brightness": _enhance(ImageEnhance.Brightness),
    "color": _enhance(ImageEnhance.Color),
    "contrast": _enhance(ImageEnhance.Contrast),
    "sharpness": _enhance(ImageEnhance.Sharpness),
    "posterize": lambda image, m, rng: ImageOps.posterize(image, 8 - int(round(4 * m))),
    "solarize": lambda image, m, rng: ImageOps.solarize(image, int(round(256 - 256 * m))),
    "autocontrast": lambda image, m, rng: ImageOps.autocontrast(image),
    "equalize": lambda image, m, rng: ImageOps.equalize(image),
}
OPS = tuple(RAND_AUGMENT)


def rand_augment(image: Image.Image, ops: int, magnitude: float, rng: np.random.Generator) -> Image.Image:
    """`ops` operations drawn uniformly (with replacement) from RAND_AUGMENT at `magnitude` of 10."""
    for name in rng.choice(OPS, size=ops):
        image = RAND_AUGMENT[str(name)](image, magnitude / 10, rng)
    return image


def pad_crop(image: np.ndarray, padding: int, rng: np.random.Generator) -> np.ndarray:
    """A random crop of the image's size from it padded by `padding` zeros on every side."""
    h, w = image.shape[:2]
    padded = np.pad(image, ((padding, padding), (padding, padding), (0, 0)))
    dy, dx = rng.integers(0, 2 * padding + 1, size=2)
    return padded[dy:dy + h, dx:dx + w]


def train_view(image, recipe: Recipe, rng: np.random.Generator) -> np.ndarray:
    """One train example's view (see the module docstring) -> [S, S, C], uint8 for uint8 inputs."""
    s = recipe.image_size
    if recipe.random_resized_crop:
        image = as_pil(image, recipe.channels)
        left, top, w, h = crop_box(*image.size, recipe.scale, recipe.ratio, rng)
        image = image.resize((s, s), Image.BILINEAR, box=(left, top, left + w, top + h))
    else:
        image = eval_view(image, recipe)
    if recipe.flip and rng.random() < 0.5:
        image = ImageOps.mirror(image) if isinstance(image, Image.Image) else image[:, ::-1]
    if recipe.rand_augment_ops:
        image = rand_augment(as_pil(image, recipe.channels), recipe.rand_augment_ops,
                             recipe.rand_augment_magnitude, rng)
    image = as_array(image)
    if recipe.crop_padding:
        image = pad_crop(image, recipe.crop_padding, rng)
    return image
