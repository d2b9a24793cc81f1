"""ViT image classification.

Train the default tiny ViT on scikit-learn's 8 x 8 digits (CPU, minutes):

  python -m transformer.train --config configs/vit.py:tiny --workdir runs/vit-tiny

Presets (model sizes live in transformer/models/vit.py): tiny (2 x 2 patches), and the ViT
paper's ti16, s16, b16, l16 (16 x 16 patches); s16 and b16 train with DeiT's recipe (below).
`data.source` is `digits` (the default), a folder of class sub-folders (ImageNet's layout), a
folder of MNIST-family IDX files or an .npz file (see transformer/data/images/sources.py). The
data decides `model.num_classes`, `channels` and `image_size` (0 here; transformer/training/shapes.py):
its classes, grayscale or RGB, and its images' typical side to a multiple of the patch size, at
most 224 (ImageNet's) and 24 patches; a key set here or by a flag is kept, and said where the data
disagrees. E.g. `configs/vit.py:tiny,data.source=~/mnist,model.patch_size=4`, or on one GPU node,
DeiT-S on ImageNet:

  python -m transformer.train --config configs/vit.py:s16,data.source=/data/imagenet \
      --config.model.dtype=bfloat16 --workdir runs/deit-s16

`data.augment` holds the train views (transformer/data/images/host_views.py) and mixup/cutmix (done on
the device, training/tasks/image_classification.py); `augment.views`: `device` makes the whole
view of an in-memory source of uint8 images on the device too (crop, flip, RandAugment:
transformer/data/images/device_views.py; the host only gathers images), `host` in Pillow, `auto` (the
default) the device where JAX computes on an accelerator; `data.workers` the processes that decode
and augment on the host (-1: the CPUs for files and for host views, none where the device makes
them); `data.mean`/`std` fixed channel statistics in 0..255, or () to
sample them from `statistics_sample` train images.

Every key's value, default and meaning: `python -m transformer.inspect --config configs/vit.py:tiny --keys`
(the meanings are transformer/config_keys.py's table).
"""

import ml_collections

from transformer import config as config_lib
from transformer.models import vit

# Training settings per preset; anything not listed takes the defaults below.
TRAINING = {
    "tiny": dict(
        data=dict(batch_size=128),
        optim=dict(lr=2e-3, warmup_steps=100, weight_decay=0.05),
        train=dict(steps=1500, log_every=50, eval_every=250, checkpoint_every=500),
    ),
}

# DeiT's recipe (Touvron et al. 2021, ImageNet-1k from scratch): 300 epochs of 1,281,167 images at batch
# 1024, AdamW lr 1e-3 (5e-4 x 1024 / 512) with 5 warmup epochs, cosine to 1e-5, weight decay 0.05,
# RandomResizedCrop + flip + RandAugment(2, 9), mixup 0.8 / cutmix 1.0, label smoothing 0.1, stochastic
# depth 0.1, eval at crop 0.875; ImageNet's channel statistics. Point data.source at the folder.
EPOCH = 1_281_167 // 1024
DEIT = dict(
    model=dict(drop_path=0.1),
    data=dict(batch_size=1024, crop_fraction=0.875, mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375),
              augment=dict(random_resized_crop=True, flip=True, rand_augment_ops=2, rand_augment_magnitude=9.0,
                           mixup_alpha=0.8, cutmix_alpha=1.0)),
    optim=dict(lr=1e-3, warmup_steps=5 * EPOCH, final_lr_fraction=0.01, weight_decay=0.05),
    train=dict(steps=300 * EPOCH, label_smoothing=0.1, log_every=100, eval_every=10 * EPOCH,
               checkpoint_every=EPOCH),
)
TRAINING.update({"s16": DEIT, "b16": DEIT})


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    preset, overrides = config_lib.parse_arg(arg, default_preset="tiny")
    model = vit.default_model_config(preset)
    model.update(num_classes=0, channels=0, image_size=0)  # the data's (transformer/training/shapes.py)
    c = ml_collections.ConfigDict()
    c.model = model
    c.data = dict(
        source="digits",
        test_fraction=0.2,
        val_labels="",
        batch_size=256,
        workers=-1,
        mean=(),
        std=(),
        statistics_sample=10_000,
        crop_fraction=1.0,
        augment=dict(
            random_resized_crop=False,
            scale=(0.08, 1.0),
            ratio=(3 / 4, 4 / 3),
            flip=False,
            rand_augment_ops=0,
            rand_augment_magnitude=9.0,
            crop_padding=0,
            mixup_alpha=0.0,
            cutmix_alpha=0.0,
            mix_switch=0.5,
            views="auto",
        ),
    )
    c.optim = config_lib.optim_config(lr=1e-3, warmup_steps=10_000, b2=0.999, weight_decay=0.1)
    c.train = config_lib.train_config(steps=300_000, eval_every=5000, checkpoint_every=5000,
                                      label_smoothing=0.0)
    return config_lib.finish(c, TRAINING.get(preset, {}), overrides)
