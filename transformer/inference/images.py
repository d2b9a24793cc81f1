"""ImageGPT's completions: keep each image's upper half, sample the rest pixel by pixel with the cache,
and lay originals and completions out in a grid a person reads.

Glossary of shapes: N images, M samples of each, S side, C channels, L = S x S pixels.
"""

import os

import jax
import numpy as np

from transformer.data.images import folders, palette, pixels
from transformer.inference import engine, sampling


def complete(model, params, tokenizer: palette.PaletteTokenizer, images: np.ndarray, samples: int = 1,
             seed: int = 0, temperature: float = 1.0, top_k: int = 0) -> np.ndarray:
    """uint8 images [N, S, S, C] -> uint8 [N, M, S, S, C]: the upper S // 2 rows kept, the rest sampled."""
    n, side = len(images), images.shape[1]
    kept = side // 2 * side
    prompts = pixels.sequences(tokenizer, images)[:, :1 + kept]  # [N, 1 + kept]
    settings = sampling.Sampling(temperature=temperature, top_k=top_k, seed=seed, max_new_tokens=side * side - kept)
    done = engine.continue_ids(model, params, prompts.tolist(), settings, samples, jax.random.key(seed))
    new = np.array([row for request in done for row in request.tokens], np.int32)  # [N x M, L - kept]
    ids = np.concatenate([np.repeat(prompts[:, 1:], samples, axis=0), new], 1)  # [N x M, L]
    return tokenizer.decode(ids).reshape(n, samples, side, side, images.shape[-1])


def save_grid(path: str, originals: np.ndarray, completed: np.ndarray, title: str = "") -> str:
    """A PNG with a row per image: the original, its kept upper half, then each completion."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, m, side = len(originals), completed.shape[1], originals.shape[1]
    half = originals.copy()
    half[:, side // 2:] = 0
    columns = [("original", originals), ("upper half", half)] + [
        (f"completion {k + 1}", completed[:, k]) for k in range(m)]
    figure, axes = plt.subplots(n, len(columns), figsize=(1.3 * len(columns), 1.3 * n + 0.5), squeeze=False)
    grey = originals.shape[-1] == 1
    for i in range(n):
        for j, (name, images) in enumerate(columns):
            ax = axes[i, j]
            ax.imshow(images[i][..., 0] if grey else images[i], cmap="gray" if grey else None, vmin=0, vmax=255,
                      interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(name, fontsize=8)
            if j == 1:
                ax.axhline(side // 2 - 0.5, color="red", linewidth=0.8)
    if title:
        figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def reads_images(tokenizer) -> bool:
    return tokenizer.kind == palette.KIND


def image_files(spec: str) -> list[str]:
    """The image files `spec` names: comma-separated files and folders (searched recursively, sorted)."""
    found = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        path = os.path.expanduser(part)
        if not os.path.exists(path):
            raise ValueError(f"--images: {part} is neither an image file nor a folder")
        found += folders.image_files(path) if os.path.isdir(path) else [path]
    if not found:
        raise ValueError(f"--images={spec!r}: no image files (.npy, {', '.join(folders.IMAGE_EXTENSIONS)})")
    return found


def complete_files(run, spec: str, out: str = "", step: int | None = None, count: int = 8, samples: int = 1,
                   seed: int = 0, temperature: float = 1.0, top_k: int = 0) -> str:
    """Completes the images `spec` names ('eval': the run's held-out images, one of each class first) with the
    ImageGPT run `run` (a rundir.RunDir) and writes the grid PNG (default WORKDIR/samples/completions-STEP.png);
    returns its path."""
    tokenizer = run.tokenizer()
    if not reads_images(tokenizer):
        raise ValueError(f"--images: {run.path} reads {tokenizer.kind} tokens, not images (an ImageGPT run's "
                         "data.source is an image source)")
    side = run.config.data.image_side
    if spec == "eval":
        images, labels = pixels.open_views(run.config, run.path)["test"]
        images = images[pixels.spread(labels, count)]
    else:
        images = pixels.read_images(image_files(spec)[:count], side, tokenizer.channels)
    step = run.latest_step if step is None else step
    model, params = run.model(), run.restore_params(step)
    completed = complete(model, params, tokenizer, images, samples, seed, temperature, top_k)
    out = out or os.path.join(run.path, "samples", f"completions-{step}.png")
    return save_grid(out, images, completed, f"{os.path.basename(os.path.normpath(run.path))} at step {step}: "
                                             f"upper halves kept, {samples} completion(s) each")
