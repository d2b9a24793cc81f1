"""The linear probe of ImageGPT (Chen et al. 2020, section 3.2): how linearly the classes can be read from
each layer's features, beside a logistic regression on the raw pixels.

Glossary of shapes: N images, B a batch of them, L positions ([SOS] and the first L - 1 pixels), D
width, K layers read (the embedding, then each block's output).

Each layer's features are its activations averaged over the positions [N, D]; a scikit-learn logistic
regression (features standardised on the train split) is fitted on the train split's labels and scored
on the held-out split. iGPT found the middle layers best: the last ones specialise in the next pixel.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer.data.images import pixels
from transformer.layers.block import Block

BATCH = 256


@functools.partial(jax.jit, static_argnames="model")
def layer_means(model: nn.Module, params: dict, inputs: jax.Array) -> jax.Array:
    """inputs [B, L] -> [K, B, D]: the embedding (block 0's input) and each block's output, averaged over L."""
    found = []

    def interceptor(next_fun, args, kwargs, context):
        if isinstance(context.module, Block) and context.method_name == "__call__":
            if not found:
                found.append(args[0])
            out = next_fun(*args, **kwargs)
            found.append(out)
            return out
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        model.apply({"params": params}, inputs)
    return jnp.stack([x.mean(axis=1) for x in found])  # [K, B, D]


def features(model: nn.Module, params: dict, sequences: np.ndarray) -> np.ndarray:
    """int32 sequences [N, L + 1] ([SOS] + pixels) -> float32 [K, N, D] (the last pixel is never an input)."""
    parts = [np.asarray(layer_means(model, params, jnp.asarray(sequences[i:i + BATCH, :-1])))
             for i in range(0, len(sequences), BATCH)]
    return np.concatenate(parts, axis=1)


def accuracy(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray,
             regularisation: float = 1.0) -> float:
    """Held-out accuracy of a logistic regression on standardised features [N, F]."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    fitted = make_pipeline(StandardScaler(), LogisticRegression(C=regularisation, max_iter=2000))
    fitted.fit(train_x, train_y)
    return float(fitted.score(test_x, test_y))


def probe(run, regularisation: float = 1.0) -> dict:
    """{'layers': [name], 'accuracy': [per layer], 'pixels': the raw-pixel baseline, 'best': name, counts} of
    the ImageGPT run `run` (a probe.Run) on its own train and held-out images."""
    if getattr(run.tokenizer, "kind", None) != "palette":
        raise ValueError(f"the linear probe reads an ImageGPT run's images; {run.workdir} is not one "
                         "(its config.data.source is no image source)")
    views = pixels.open_views(run.config, run.workdir)
    (train_images, train_y), (test_images, test_y) = views["train"], views["test"]
    train_f = features(run.model, run.params, pixels.sequences(run.tokenizer, train_images))
    test_f = features(run.model, run.params, pixels.sequences(run.tokenizer, test_images))
    names = ["embedding"] + [f"block {i}" for i in range(1, len(train_f))]
    scores = [accuracy(a, train_y, b, test_y, regularisation) for a, b in zip(train_f, test_f)]
    flat = lambda x: x.reshape(len(x), -1).astype(np.float32) / 255.0  # noqa: E731
    baseline = accuracy(flat(train_images), train_y, flat(test_images), test_y, regularisation)
    return {"layers": names, "accuracy": scores, "pixels": baseline, "best": names[int(np.argmax(scores))],
            "train_images": len(train_y), "test_images": len(test_y), "width": int(train_f.shape[-1])}


def table(result: dict, step: int) -> str:
    """The numbers as a Markdown table."""
    lines = [f"Linear probe at step {step}: logistic regression on each layer's position-averaged features, "
             f"{result['train_images']:,} train / {result['test_images']:,} held-out images", "",
             "| features | held-out accuracy |", "|---|---|"]
    lines += [f"| {name}{' (best)' if name == result['best'] else ''} | {acc:.4f} |"
              for name, acc in zip(result["layers"], result["accuracy"])]
    lines.append(f"| raw pixels | {result['pixels']:.4f} |")
    return "\n".join(lines) + "\n"


def figure(path: str, result: dict, title: str) -> str:
    """Accuracy per layer, the raw-pixel baseline dashed."""
    from transformer.probe import plots

    fig, axes = plots.figure(1, 1, 5.5, 3.5)
    ax = axes[0, 0]
    depth = np.arange(len(result["layers"]))
    ax.plot(depth, result["accuracy"], marker="o", label="layer features (mean over positions)")
    ax.axhline(result["pixels"], color="grey", linestyle="--", label="raw pixels")
    ax.set_xticks(depth, result["layers"], rotation=30, fontsize=plots.MIN_FONT)
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title, fontsize=plots.MAX_FONT)
    ax.legend(fontsize=plots.MIN_FONT)
    return plots.save(fig, path)
