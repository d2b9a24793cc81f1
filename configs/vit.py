"""ViT image classification.

Train the default tiny ViT on scikit-learn's 8 x 8 digits (CPU, minutes):

  python -m transformer.train --config configs/vit.py:tiny --workdir runs/vit-tiny

Presets (model sizes live in transformer/models/vit.py): tiny (8 x 8 digits), and the ViT
paper's ti16, s16, b16, l16 (224 x 224, 16 x 16 patches, 1000 classes). `data.source` is
`digits` (the default), a folder of class sub-folders, a folder of MNIST-family IDX files or
an .npz file (see transformer/data/images.py), e.g.
`configs/vit.py:tiny,data.source=~/mnist,model.image_size=28,model.patch_size=4`.
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


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    preset, overrides = config_lib.parse_arg(arg, default_preset="tiny")
    model = vit.default_model_config(preset)
    c = ml_collections.ConfigDict()
    c.model = model
    c.data = dict(
        source="digits", test_fraction=0.2, batch_size=256, augment=False, crop_padding=4, flip=False,
    )
    c.optim = config_lib.optim_config(lr=1e-3, warmup_steps=10_000, b2=0.999, weight_decay=0.1)
    c.train = config_lib.train_config(steps=300_000, eval_every=5000, checkpoint_every=5000,
                                      label_smoothing=0.0)
    return config_lib.finish(c, TRAINING.get(preset, {}), overrides)
