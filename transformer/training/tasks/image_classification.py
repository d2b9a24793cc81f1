"""Image classification: cross-entropy on labelled images, top-1 accuracy on the test split.

Glossary of shapes: B batch, H/W height/width, C channels, N classes. A train batch is
{'images': float32 [B, H, W, C], 'labels': int32 [B]}; eval batches add 'weights' [B]
(0 on padding).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from transformer.data import images
from transformer.training import losses


def check(config) -> None:
    if not 0 <= config.train.label_smoothing < 1:
        raise ValueError(f"config.train.label_smoothing={config.train.label_smoothing} must be in [0, 1)")


class ImageClassificationTask:
    item_name = "images"

    def __init__(self, config, workdir: str, rows: np.ndarray):
        self.config = config
        d, m = config.data, config.model
        splits = images.load(d, m.image_size, m.channels)
        self.data = images.ImageData(splits, d.batch_size, config.train.seed, augment=d.augment,
                                     crop_padding=d.crop_padding, flip=d.flip, rows=rows)
        _check_shapes(self.data, splits, m, d.source)
        majority = np.bincount(self.data.y_train).argmax()
        self.majority_accuracy = float(np.mean(self.data.y_test == majority))
        if jax.process_index() == 0:
            print(f"images: {len(self.data.y_train)} train, {len(self.data.y_test)} test of shape "
                  f"{self.data.image_shape}; majority-class test accuracy {self.majority_accuracy:.4f}",
                  file=sys.stderr)
        self.items_per_step = d.batch_size

    def init_inputs(self):
        return (jnp.zeros((1, *self.data.image_shape), jnp.float32),)

    def train_batch(self, step: int) -> dict:
        return self.data.train_batch(step)

    def eval_batches(self) -> list[dict]:
        return self.data.eval_batches()

    def loss(self, model, params, batch, rng):
        logits = model.apply({"params": params}, batch["images"], deterministic=False, rngs={"dropout": rng})
        loss = losses.mean(losses.cross_entropy(logits, _one_hot(batch["labels"], logits),
                                                smoothing=self.config.train.label_smoothing))
        accuracy = (logits.argmax(-1) == batch["labels"]).mean()
        return loss, {"loss": loss, "accuracy": accuracy}

    def eval_outputs(self, model, params, batch) -> dict:
        logits = model.apply({"params": params}, batch["images"])  # [B, N]
        w = batch["weights"]
        correct = (logits.argmax(-1) == batch["labels"]).astype(jnp.float32)
        loss_sum, count = losses.cross_entropy(logits, _one_hot(batch["labels"], logits), w)
        return {"loss_sum": loss_sum, "correct": (correct * w).sum(), "count": count}

    def eval_metrics(self, outputs: list[dict]) -> dict:
        count = sum(float(o["count"]) for o in outputs)
        return {"eval/loss": sum(float(o["loss_sum"]) for o in outputs) / count,
                "eval/accuracy": sum(float(o["correct"]) for o in outputs) / count,
                "eval/majority_accuracy": self.majority_accuracy}

    def loss_weights(self, batch) -> dict:
        return {"loss": batch["labels"].size}

    def report(self, model, params, step: int) -> list[str]:
        return []


def _one_hot(labels: jax.Array, logits: jax.Array) -> jax.Array:
    """labels [B] -> distributions [B, N]: the loss takes soft targets (mixup, label smoothing)."""
    return jax.nn.one_hot(labels, logits.shape[-1])


def _check_shapes(data: images.ImageData, splits: dict, model_config, source: str) -> None:
    """The images and labels fit config.model; a mismatch fails naming the key."""
    h, w, c = data.image_shape
    if (h, w) != (model_config.image_size, model_config.image_size):
        raise ValueError(f"config.data.source={source!r} has {h} x {w} images but "
                         f"config.model.image_size={model_config.image_size}")
    if c != model_config.channels:
        raise ValueError(f"config.data.source={source!r} has {c} channels but "
                         f"config.model.channels={model_config.channels}")
    labels = np.concatenate([splits["train"][1], splits["test"][1]])
    if labels.min() < 0 or labels.max() >= model_config.num_classes:
        raise ValueError(f"config.data.source={source!r} has labels {labels.min()}..{labels.max()} but "
                         f"config.model.num_classes={model_config.num_classes}")


def build(config, workdir: str, rows: np.ndarray, start_step: int) -> ImageClassificationTask:
    return ImageClassificationTask(config, workdir, rows)
