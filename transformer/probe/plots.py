"""The probes' figures (matplotlib, Agg): each function writes one PNG and returns its path.

Every figure is laid out by matplotlib's constrained layout (no title or colour bar over a panel) and
every map has its colour bar. An axis of tokens labels every token while each gets MIN_FONT points of
the axis, else one in `step` (`thinned`), the font sized to the count between MIN_FONT and MAX_FONT;
a label or title longer than its room is cut in the middle with '…'.

Glossary of shapes: H heads, L query length, S key length, N layers, W words.
"""

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

DPI = 100
MIN_FONT, MAX_FONT = 7.0, 9.0  # points
LINE = 1.3  # a label's room along its axis, in font sizes
LABEL_CHARS = 12  # a token label's length at most
PANEL = 4.5  # inches: a map's longer side at most
CELL = 0.3  # inches: a map's cell at most
MAP_COLUMNS = 4  # panels in a row of a grid of maps (3 where that fills the rows)
LENS_COLUMNS = 24  # positions in a strip of the lens table
MAX_BARS = 40  # tokens in a bar chart at most
BAR = 0.18  # inches a bar


def figure(nrows: int, ncols: int, width: float, height: float, **shared):
    return plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False, layout="constrained", **shared)


def save(fig, path: str) -> str:
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def shorten(text: str, chars: int) -> str:
    """text with its middle cut to '…' to be at most `chars` characters."""
    if len(text) <= chars:
        return text
    head = (chars - 1) // 2
    return text[:head] + "…" + text[len(text) - (chars - 1 - head):]


def suptitle(fig, text: str, size: float = 10.0) -> None:
    """A suptitle, each line cut to the figure's width."""
    chars = int(fig.get_figwidth() * 72 / (0.6 * size))
    fig.suptitle("\n".join(shorten(line, chars) for line in text.split("\n")), fontsize=size)


def thinned(count: int, inches: float) -> tuple[int, float]:
    """How to label `count` tokens along an axis `inches` long: one in `step`, at `size` points."""
    room = inches * 72
    step = max(1, math.ceil(count * LINE * MIN_FONT / room))
    return step, min(MAX_FONT, room / (LINE * math.ceil(count / step)))


def _token_axis(ax, axis: str, labels: list[str], inches: float) -> str:
    """Tick labels of the x or y `axis`, thinned to fit `inches`; returns the note for the axis' name."""
    step, size = thinned(len(labels), inches)
    positions = range(0, len(labels), step)
    texts = [shorten(labels[i], LABEL_CHARS) for i in positions]
    if axis == "x":
        ax.set_xticks(positions, texts, fontsize=size, rotation=90 if max(map(len, texts)) > 1 else 0)
    else:
        ax.set_yticks(positions, texts, fontsize=size)
    if step == 1:
        return ""
    (ax.set_xticks if axis == "x" else ax.set_yticks)(range(len(labels)), minor=True)
    return f" (1 in {step} of {len(labels)} labelled)"


def heads_grid(path: str, weights: np.ndarray, rows: list[str], cols: list[str], title: str,
               panel: str = "head") -> str:
    """One layer's maps weights [H, L, S], one panel per head with its colour bar, queries (`rows`)
    down and keys (`cols`) across."""
    heads, length, keys = weights.shape
    ncols = next((c for c in (MAP_COLUMNS, MAP_COLUMNS - 1) if heads % c == 0), min(heads, MAP_COLUMNS))
    nrows = math.ceil(heads / ncols)
    cell = min(CELL, PANEL / max(length, keys))
    width, height = max(keys * cell, 1.5), max(length * cell, 1.5)
    fig, axes = figure(nrows, ncols, ncols * (width + 1.0) + 1.2, nrows * (height + 0.4) + 1.4,
                        sharex=True, sharey=True)
    for h, ax in enumerate(axes.flat):
        if h >= heads:
            ax.axis("off")
            axes.flat[h - ncols].xaxis.set_tick_params(labelbottom=True)
            continue
        shown = ax.imshow(weights[h], cmap="viridis", vmin=0.0, vmax=max(float(weights[h].max()), 1e-6),
                          aspect="auto")  # the figure's size makes the cells square; 'equal' unsettles the layout
        fig.colorbar(shown, ax=ax, shrink=0.9, label="weight" if h % ncols == ncols - 1 or h == heads - 1 else None)
        ax.set_title(f"{panel} {h}", fontsize=9)
        notes = _token_axis(ax, "x", cols, width), _token_axis(ax, "y", rows, height)
    fig.supxlabel("key" + notes[0], fontsize=9)
    fig.supylabel("query" + notes[1], fontsize=9)
    suptitle(fig, title)
    return save(fig, path)


def layers_grid(path: str, maps: dict[str, np.ndarray], rows: list[str], cols: list[str], title: str) -> str:
    """Each layer's head-averaged map, {layer: [H, L, S]}, one panel per layer."""
    return heads_grid(path, np.stack([w.mean(0) for w in maps.values()]), rows, cols, title, panel="layer")


def lens_table(path: str, top: list[list[str]], probs: np.ndarray, tokens: list[str], predicts: str) -> str:
    """The lens as a table: layer down, position across, the top prediction [N, L] and its probability;
    LENS_COLUMNS positions a strip, the strips one under another."""
    layers, length = probs.shape
    columns = min(length, LENS_COLUMNS)
    strips = math.ceil(length / columns)
    fig, axes = figure(strips, 1, 0.55 * columns + 2.8, strips * (0.3 * layers + 1.3) + 0.9)
    for k, ax in enumerate(axes[:, 0]):
        start, end = k * columns, min(length, (k + 1) * columns)
        shown = ax.imshow(probs[:, start:end], cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto",
                          extent=(-0.5, end - start - 0.5, layers - 0.5, -0.5))
        ax.set_xlim(-0.5, columns - 0.5)
        for i in range(layers):
            for j in range(start, end):
                ax.text(j - start, i, shorten(top[i][j], 8), ha="center", va="center", fontsize=8,
                        color="white" if probs[i, j] > 0.6 else "black")
        _token_axis(ax, "x", tokens[start:end], 0.55 * (end - start))
        ax.set_yticks(range(layers), [f"after layer {i + 1}" for i in range(layers)], fontsize=7)
        if strips > 1:
            ax.set_title(f"positions {start} to {end - 1}", fontsize=8, loc="left")
    fig.colorbar(shown, ax=axes[:, 0], label="probability", shrink=min(1.0, 3.0 / strips + 0.2))
    fig.supxlabel(f"input token (the prediction is of {predicts})", fontsize=9)
    suptitle(fig, "logit lens: the top prediction after each layer, coloured by its probability")
    return save(fig, path)


def nearest_bars(path: str, answers: list[tuple[str, float]], title: str) -> str:
    """Tokens and their cosine similarity, best first, each bar labelled with its value."""
    fig, axes = figure(1, 1, 5.0, BAR * 1.6 * len(answers) + 1.2)
    ax = axes[0, 0]
    bars = ax.barh(range(len(answers)), [s for _, s in answers], color="tab:blue")
    ax.bar_label(bars, fmt="%.3f", fontsize=7, padding=2)
    _token_axis(ax, "y", [t for t, _ in answers], BAR * 1.6 * len(answers))
    ax.invert_yaxis()
    ax.margins(x=0.15)
    ax.set_xlabel("cosine similarity")
    suptitle(fig, title, 9)
    return save(fig, path)


def projection(path: str, coords: np.ndarray, words: list[str]) -> str:
    """Words at their coords [W, 2] on the first two principal components, labelled."""
    fig, axes = figure(1, 1, 6.0, 5.0)
    ax = axes[0, 0]
    ax.scatter(coords[:, 0], coords[:, 1], s=12)
    for (x, y), word in zip(coords, words):
        ax.annotate(shorten(word, 2 * LABEL_CHARS), (x, y), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("PC 1")
    ax.set_ylabel("PC 2")
    suptitle(fig, "input embeddings, PCA")
    return save(fig, path)


def distribution_bars(path: str, panels: list[tuple[str, list[tuple[str, float]]]], title: str) -> str:
    """One bar chart per sampling setting: (setting, [(token, probability)]) over the same tokens, most
    probable first, tokens down; the first MAX_BARS of them."""
    count = len(panels[0][1])
    shown = min(count, MAX_BARS)
    fig, axes = figure(1, len(panels), 2.3 * len(panels) + 1.2, BAR * shown + 1.6, sharey=True, sharex=True)
    for ax, (name, bars) in zip(axes[0], panels):
        ax.barh(range(shown), [p for _, p in bars[:shown]], color="tab:orange")
        ax.set_title(name, fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    _token_axis(axes[0, 0], "y", [t for t, _ in panels[0][1][:shown]], BAR * shown)
    axes[0, 0].invert_yaxis()
    fig.supxlabel("probability", fontsize=9)
    suptitle(fig, title + (f" (the {shown} most probable of {count} shown)" if shown < count else ""), 9)
    return save(fig, path)


def _picture(ax, pixels: np.ndarray) -> None:
    """An image's raw pixels [H, W, C] (grey when C is 1), scaled to its own range."""
    x = pixels.astype(np.float32)
    x = (x - x.min()) / max(float(x.max() - x.min()), 1e-6)
    ax.imshow(x[..., 0] if x.shape[-1] == 1 else x[..., :3], cmap="gray", interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])


def image_overlays(path: str, pixels: np.ndarray, panels: list[tuple[str, np.ndarray]], title: str) -> str:
    """The image [H, W, C], then one copy per panel (title, weights on the patch grid [g, g]) with the
    weights laid over it (alpha), each patch's colour over its pixels, and their colour bar."""
    fig, axes = figure(1, len(panels) + 1, 3.4 * (len(panels) + 1), 3.6)
    height, width = pixels.shape[:2]
    _picture(axes[0][0], pixels)
    axes[0][0].set_title("image", fontsize=9)
    for ax, (name, grid) in zip(axes[0][1:], panels):
        _picture(ax, pixels)
        shown = ax.imshow(grid, cmap="inferno", alpha=0.6, extent=(-0.5, width - 0.5, height - 0.5, -0.5),
                          interpolation="nearest", vmin=0.0)
        fig.colorbar(shown, ax=ax, shrink=0.9, label="weight")
        ax.set_title(name, fontsize=9)
    suptitle(fig, title, 9)
    return save(fig, path)
