"""The train view (`host_views.py`'s recipe) made on the device, for a batch of in-memory images.

Glossary of shapes: b the rows of a batch, H x W the source's images, S the model's image size, C
channels.

An in-memory source of uint8 images (`config.data.augment.views`: 'device', or 'auto' on an accelerator)
sends the images as they are stored, uint8 [b, H, W, C], and each row's (step, global row) as `example` int32 [b, 2];
the step makes the views inside its jitted function, in `host_views.py`'s order: a random resized crop
(torchvision's 10 tries, then the centre; off: the eval view's resize and centre crop), a flip, RandAugment
(the same 14 operations at the same magnitudes: affine ones by nearest sampling with grey fill,
enhancements as blends, posterize, solarize, autocontrast, equalize) and a padded random crop. The values
are rounded to whole numbers 0..255 between operations, as a uint8 image's are; resizing is
`jax.image.scale_and_translate` (bilinear, antialiased), so the views are this recipe's, not PIL's
pixels. Each row's randomness is a threefry key folded from (seed, step, row): a view is a pure function
of the seed and its example, however the batch is split over processes or microbatches, so a resumed
run computes what the uninterrupted one did. Mixup, cutmix and the normalisation follow, as for every
source (`training/tasks/image_classification.py`).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from transformer.data.images.host_views import FILL, OPS, Recipe

DOMAIN = 0x5EED  # keys of the views, apart from the model's dropout keys


def train_views(images: jax.Array, example: jax.Array, recipe: Recipe, seed: int) -> jax.Array:
    """uint8 [b, H, W, C] and (step, row) int32 [b, 2] -> the views, float32 [b, S, S, C] of whole numbers."""
    base = jax.random.fold_in(jax.random.key(seed), DOMAIN)
    keys = jax.vmap(lambda e: jax.random.fold_in(jax.random.fold_in(base, e[0]), e[1]))(example)  # [b]
    return jax.vmap(lambda image, key: _view(image, key, recipe))(images, keys)


def eval_views(images: jax.Array, recipe: Recipe) -> jax.Array:
    """uint8 [b, H, W, C] -> the eval views (`host_views.eval_view`'s resize and centre crop) [b, S, S, C] float32."""
    return jax.vmap(lambda image: _eval_crop(image.astype(jnp.float32), recipe))(images)


def _view(image: jax.Array, key: jax.Array, recipe: Recipe) -> jax.Array:
    """One image [H, W, C] -> its view [S, S, C] float32 (the module docstring's order)."""
    crop_key, flip_key, ops_key, pad_key = jax.random.split(key, 4)
    x = image.astype(jnp.float32)
    height, width = image.shape[:2]
    if recipe.random_resized_crop:
        x = _resize(x, crop_box(crop_key, height, width, recipe.scale, recipe.ratio), recipe.image_size)
    else:
        x = _eval_crop(x, recipe)
    if recipe.flip:
        x = jnp.where(jax.random.bernoulli(flip_key), x[:, ::-1], x)
    if recipe.rand_augment_ops:
        x = rand_augment(x, ops_key, recipe.rand_augment_ops, recipe.rand_augment_magnitude / 10)
    if recipe.crop_padding:
        x = _pad_crop(x, pad_key, recipe.crop_padding)
    return x


def crop_box(key: jax.Array, height: int, width: int, scale, ratio) -> jax.Array:
    """RandomResizedCrop's (left, top, w, h) float32 [4]: 10 candidates of area and log-uniform aspect, the
    first that fits, else the centre crop at the nearest allowed aspect (`host_views.crop_box`'s rule)."""
    area_key, aspect_key, x_key, y_key = jax.random.split(key, 4)
    area = height * width * jax.random.uniform(area_key, (10,), minval=scale[0], maxval=scale[1])
    aspect = jnp.exp(jax.random.uniform(aspect_key, (10,), minval=math.log(ratio[0]), maxval=math.log(ratio[1])))
    w, h = jnp.round(jnp.sqrt(area * aspect)), jnp.round(jnp.sqrt(area / aspect))
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first, found = jnp.argmax(fits), fits.any()
    shape = width / height
    centre_w = width if shape <= ratio[1] else round(height * ratio[1])
    centre_h = round(width / ratio[0]) if shape < ratio[0] else height
    w, h = jnp.where(found, w[first], centre_w), jnp.where(found, h[first], centre_h)
    left = jnp.where(found, jnp.floor(jax.random.uniform(x_key) * (width - w + 1)), (width - w) // 2)
    top = jnp.where(found, jnp.floor(jax.random.uniform(y_key) * (height - h + 1)), (height - h) // 2)
    return jnp.stack([left, top, w, h])


def _resize(x: jax.Array, box: jax.Array, size: int) -> jax.Array:
    """The (left, top, w, h) box of x [H, W, C] resized to [size, size, C], bilinear, rounded."""
    scale = jnp.stack([size / box[3], size / box[2]])  # (rows, columns)
    translation = -jnp.stack([box[1], box[0]]) * scale
    out = jax.image.scale_and_translate(x, (size, size, x.shape[-1]), (0, 1), scale, translation,
                                        method="linear", antialias=True)
    return jnp.clip(jnp.round(out), 0, 255)


def _eval_crop(x: jax.Array, recipe: Recipe) -> jax.Array:
    """`host_views.eval_view` for a known [H, W]: the shorter side resized to S / crop_fraction, the centre S x S."""
    height, width = x.shape[:2]
    s = recipe.image_size
    if (height, width) == (s, s) and recipe.crop_fraction == 1:
        return x
    short = math.floor(s / recipe.crop_fraction)
    factor = short / min(width, height)
    rw, rh = max(s, round(width * factor)), max(s, round(height * factor))
    left, top = (rw - s) // 2, (rh - s) // 2
    box = jnp.asarray([left * width / rw, top * height / rh, s * width / rw, s * height / rh], jnp.float32)
    return _resize(x, box, s)


def _pad_crop(x: jax.Array, key: jax.Array, padding: int) -> jax.Array:
    """A random crop of x's size from x padded by `padding` zeros on every side."""
    h, w, c = x.shape
    offsets = jax.random.randint(key, (2,), 0, 2 * padding + 1)
    padded = jnp.pad(x, ((padding, padding), (padding, padding), (0, 0)))
    return jax.lax.dynamic_slice(padded, (offsets[0], offsets[1], 0), (h, w, c))


# ---------------------------------------------------------------- RandAugment (host_views.RAND_AUGMENT's ops)


def rand_augment(x: jax.Array, key: jax.Array, ops: int, magnitude: float) -> jax.Array:
    """`ops` operations drawn uniformly (with replacement) from OPS at `magnitude` (0..1), each with a random
    sign where it has one: x [S, S, C] float32 of whole numbers -> the same."""
    op_key, sign_key = jax.random.split(key)
    chosen = jax.random.randint(op_key, (ops,), 0, len(OPS))
    signs = jnp.where(jax.random.bernoulli(sign_key, shape=(ops,)), 1.0, -1.0)
    branches = [lambda x, sign, name=name: _round(OPERATIONS[name](x, magnitude, sign)) for name in OPS]
    for i in range(ops):
        x = jax.lax.switch(chosen[i], branches, x, signs[i])
    return x


def _round(x: jax.Array) -> jax.Array:
    return jnp.clip(jnp.round(x), 0, 255)


def _affine(x: jax.Array, a, b, c, d, e, f) -> jax.Array:
    """PIL's AFFINE transform, nearest: output (col, row) takes input (a col + b row + c, d col + e row + f);
    outside the image: grey."""
    h, w = x.shape[:2]
    rows, cols = jnp.meshgrid(jnp.arange(h) + 0.5, jnp.arange(w) + 0.5, indexing="ij")
    src_x, src_y = jnp.floor(a * cols + b * rows + c), jnp.floor(d * cols + e * rows + f)
    inside = (src_x >= 0) & (src_x < w) & (src_y >= 0) & (src_y < h)
    taken = x[jnp.clip(src_y, 0, h - 1).astype(jnp.int32), jnp.clip(src_x, 0, w - 1).astype(jnp.int32)]
    return jnp.where(inside[..., None], taken, FILL)


def _rotate(x: jax.Array, degrees) -> jax.Array:
    """Counter-clockwise about the centre (PIL's `rotate`), nearest, grey fill."""
    h, w = x.shape[:2]
    angle = -jnp.deg2rad(degrees)  # the inverse map, output -> input
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    cx, cy = w / 2, h / 2
    return _affine(x, cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy)


def _grey(x: jax.Array) -> jax.Array:
    """ITU-R 601-2 luma [S, S, 1] (PIL's L), of RGB; the image itself where it has one channel."""
    if x.shape[-1] == 1:
        return x
    return _round(x @ jnp.asarray([0.299, 0.587, 0.114], jnp.float32))[..., None]


def _blend(degenerate, x, factor):
    """PIL's ImageEnhance: degenerate + factor (x - degenerate)."""
    return degenerate + factor * (x - degenerate)


def _sharpen_degenerate(x: jax.Array) -> jax.Array:
    """PIL's SMOOTH filter ([[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13) inside, the border as it is."""
    kernel = jnp.asarray([[1, 1, 1], [1, 5, 1], [1, 1, 1]], jnp.float32) / 13
    padded = jnp.pad(x, ((1, 1), (1, 1), (0, 0)), mode="edge")
    h, w = x.shape[:2]
    smooth = sum(kernel[i, j] * padded[i:i + h, j:j + w] for i in range(3) for j in range(3))
    border = np.zeros((h, w, 1), bool)
    border[[0, -1]], border[:, [0, -1]] = True, True
    return jnp.where(border, x, _round(smooth))


def _autocontrast(x: jax.Array) -> jax.Array:
    """Each channel stretched to 0..255 (unchanged where it holds one value)."""
    lo, hi = x.min((0, 1)), x.max((0, 1))
    return jnp.where(hi > lo, (x - lo) * 255 / jnp.maximum(hi - lo, 1), x)


def _equalize(x: jax.Array) -> jax.Array:
    """PIL's equalize per channel: a lookup table from the cumulative histogram."""
    def channel(v):  # [S, S]
        counts = jnp.zeros(256, jnp.int32).at[v.astype(jnp.int32).ravel()].add(1)
        last = counts[255 - jnp.argmax(counts[::-1] > 0)]  # the count of the highest value present
        step = (v.size - last) // 255
        table = (step // 2 + jnp.cumsum(counts) - counts) // jnp.maximum(step, 1)
        return jnp.where(step > 0, jnp.clip(table, 0, 255)[v.astype(jnp.int32)], v)
    return jnp.moveaxis(jax.vmap(channel, in_axes=2)(x), 0, -1)


# name -> op(x, magnitude 0..1, sign +-1); magnitudes as host_views.RAND_AUGMENT's (timm's scales)
OPERATIONS = {
    "identity": lambda x, m, s: x,
    "shear_x": lambda x, m, s: _affine(x, 1, s * 0.3 * m, 0, 0, 1, 0),
    "shear_y": lambda x, m, s: _affine(x, 1, 0, 0, s * 0.3 * m, 1, 0),
    "translate_x": lambda x, m, s: _affine(x, 1, 0, s * 0.45 * m * x.shape[1], 0, 1, 0),
    "translate_y": lambda x, m, s: _affine(x, 1, 0, 0, 0, 1, s * 0.45 * m * x.shape[0]),
    "rotate": lambda x, m, s: _rotate(x, s * 30 * m),
    "brightness": lambda x, m, s: _blend(0.0, x, 1 + s * 0.9 * m),
    "color": lambda x, m, s: _blend(_grey(x), x, 1 + s * 0.9 * m),
    "contrast": lambda x, m, s: _blend(jnp.round(_grey(x).mean()), x, 1 + s * 0.9 * m),
    "sharpness": lambda x, m, s: _blend(_sharpen_degenerate(x), x, 1 + s * 0.9 * m),
    "posterize": lambda x, m, s: jnp.floor(x / 2 ** round(4 * m)) * 2 ** round(4 * m),
    "solarize": lambda x, m, s: jnp.where(x >= round(256 - 256 * m), 255 - x, x),
    "autocontrast": lambda x, m, s: _autocontrast(x),
    "equalize": lambda x, m, s: _equalize(x),
}
assert tuple(OPERATIONS) == OPS
