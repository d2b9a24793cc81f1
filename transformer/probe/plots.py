"""The probes' figures (matplotlib, Agg): each function writes one PNG and returns its path.

Glossary of shapes: H heads, L query length, S key length, N layers, W words.
"""

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _save(fig, path: str) -> str:
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return path


def _heatmap(ax, weights: np.ndarray, rows: list[str] | None, cols: list[str] | None, title: str) -> None:
    """rows and cols None: no tick labels (too many tokens to read)."""
    ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=max(float(weights.max()), 1e-6))
    ax.set_title(title, fontsize=9)
    if rows is None or cols is None:
        ax.set_xticks([])
        ax.set_yticks([])
        return
    small = 7 if max(len(rows), len(cols)) <= 40 else 4
    ax.set_xticks(range(len(cols)), cols, fontsize=small, rotation=90)
    ax.set_yticks(range(len(rows)), rows, fontsize=small)


def heads_grid(path: str, weights: np.ndarray, rows: list[str] | None, cols: list[str] | None, title: str,
               panel: str = "head") -> str:
    """One layer's maps weights [H, L, S], one panel per head, queries down and keys across; rows and
    cols None: unlabelled panels of a fixed size."""
    heads = weights.shape[0]
    ncols = min(heads, 4)
    nrows = math.ceil(heads / ncols)
    size = 0.16 * max(weights.shape[1:]) + 1.5 if rows is not None else 4.0
    fig, axes = plt.subplots(nrows, ncols, figsize=(size * ncols, size * nrows), squeeze=False)
    for h, ax in enumerate(axes.flat):
        if h < heads:
            _heatmap(ax, weights[h], rows, cols, f"{panel} {h}")
        else:
            ax.axis("off")
    fig.suptitle(title)
    return _save(fig, path)


def layers_grid(path: str, maps: dict[str, np.ndarray], rows: list[str] | None, cols: list[str] | None,
                title: str) -> str:
    """Each layer's head-averaged map, {layer: [H, L, S]}, one panel per layer."""
    return heads_grid(path, np.stack([w.mean(0) for w in maps.values()]), rows, cols, title, panel="layer")


def lens_table(path: str, top: list[list[str]], probs: np.ndarray, tokens: list[str], predicts: str) -> str:
    """The lens as a table: layer down, position across, the top prediction [N, L] and its probability."""
    layers, length = probs.shape
    fig, ax = plt.subplots(figsize=(0.55 * length + 1.5, 0.45 * layers + 1.2))
    ax.imshow(probs, cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(layers):
        for j in range(length):
            ax.text(j, i, top[i][j], ha="center", va="center", fontsize=7,
                    color="white" if probs[i, j] > 0.6 else "black")
    ax.set_xticks(range(length), tokens, fontsize=7, rotation=90)
    ax.set_yticks(range(layers), [f"after layer {i + 1}" for i in range(layers)], fontsize=7)
    ax.set_xlabel(f"input token (the prediction is of {predicts}); colour: its probability")
    ax.set_title("logit lens: top prediction after each layer")
    return _save(fig, path)


def nearest_bars(path: str, word: str, answers: list[tuple[str, float]], title: str) -> str:
    fig, ax = plt.subplots(figsize=(5, 0.3 * len(answers) + 1))
    ax.barh(range(len(answers)), [s for _, s in answers], color="tab:blue")
    ax.set_yticks(range(len(answers)), [t for t, _ in answers])
    ax.invert_yaxis()
    ax.set_xlabel("cosine similarity")
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def projection(path: str, coords: np.ndarray, words: list[str]) -> str:
    """Words at their coords [W, 2] on the first two principal components, labelled."""
    fig, ax = plt.subplots(figsize=(6, 5))
    ax.scatter(coords[:, 0], coords[:, 1], s=12)
    for (x, y), word in zip(coords, words):
        ax.annotate(word, (x, y), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("PC 1")
    ax.set_ylabel("PC 2")
    ax.set_title("input embeddings, PCA")
    return _save(fig, path)


def distribution_bars(path: str, panels: list[tuple[str, list[tuple[str, float]]]], title: str) -> str:
    """One bar chart per sampling setting: (setting, [(token, probability)]) over the same tokens."""
    fig, axes = plt.subplots(1, len(panels), figsize=(2.6 * len(panels), 3.2), sharey=True, squeeze=False)
    for ax, (name, bars) in zip(axes[0], panels):
        ax.bar(range(len(bars)), [p for _, p in bars], color="tab:orange")
        ax.set_xticks(range(len(bars)), [t for t, _ in bars], fontsize=7, rotation=90)
        ax.set_title(name, fontsize=8)
    axes[0][0].set_ylabel("probability")
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def _picture(ax, pixels: np.ndarray) -> None:
    """An image's raw pixels [H, W, C] (grey when C is 1), scaled to its own range."""
    x = pixels.astype(np.float32)
    x = (x - x.min()) / max(float(x.max() - x.min()), 1e-6)
    ax.imshow(x[..., 0] if x.shape[-1] == 1 else x[..., :3], cmap="gray", interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])


def image_overlays(path: str, pixels: np.ndarray, panels: list[tuple[str, np.ndarray]], title: str) -> str:
    """The image [H, W, C], then one copy per panel (title, weights on the patch grid [g, g]) with the
    weights laid over it (alpha), each patch's colour over its pixels."""
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(3.2 * (len(panels) + 1), 3.6), squeeze=False)
    height, width = pixels.shape[:2]
    _picture(axes[0][0], pixels)
    axes[0][0].set_title("image", fontsize=9)
    for ax, (name, grid) in zip(axes[0][1:], panels):
        _picture(ax, pixels)
        shown = ax.imshow(grid, cmap="inferno", alpha=0.6, extent=(-0.5, width - 0.5, height - 0.5, -0.5),
                          interpolation="nearest", vmin=0.0)
        fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.04)
        ax.set_title(name, fontsize=9)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)
