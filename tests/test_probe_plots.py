"""The probes' figures as a reader meets them: a colour bar on every map, no two texts or panels over
each other, nothing cut off, and token labels legible (thinned, never overlapping) at 8 and 128 tokens."""

import matplotlib
import numpy as np
import pytest

from transformer import probe
from transformer.data.text import tokenizers
from transformer.probe import plots

RNG = np.random.default_rng(0)


@pytest.fixture
def figures(monkeypatch):
    """The figures the plots draw, {file name: figure}, kept open after they are saved."""
    kept = {}

    def keep(fig, path):
        fig.savefig(path, dpi=plots.DPI)
        kept[path.rsplit("/", 1)[-1]] = fig
        return path

    monkeypatch.setattr(plots, "save", keep)
    yield kept
    for fig in kept.values():
        matplotlib.pyplot.close(fig)


def _maps(heads, length, keys):
    return RNG.dirichlet(np.ones(keys), size=(heads, length))  # [H, L, S], rows sum to 1


def _tokens(n, prefix="tok"):
    return [f"{prefix}{i}" if i % 3 else "a" * 30 for i in range(n)]  # some longer than any label's room


def _draw_all(path, n):
    """Every figure a probe draws, at n tokens."""
    labels = _tokens(n)
    plots.heads_grid(f"{path}/self.png", _maps(6, n, n), labels, labels, "block_0/self_attn " * 20)
    plots.heads_grid(f"{path}/cross.png", _maps(4, n, n // 2 + 3), labels, _tokens(n // 2 + 3, "src"),
                     "decoder_0/cross_attn (query down, key across)")
    plots.layers_grid(f"{path}/layers.png", {f"block_{i}": _maps(2, n, n) for i in range(3)}, labels, labels,
                      "each layer, averaged over heads")
    plots.lens_table(f"{path}/lens.png", [_tokens(n, "next") for _ in range(3)], RNG.random((3, n)), labels,
                     "the next token")
    plots.distribution_bars(f"{path}/temperature.png",
                            [(f"temperature={t}", list(zip(labels, np.sort(RNG.random(n))[::-1]))) for t in (0.5, 1)],
                            "distribution at the [MASK]: " + "".join(labels))
    plots.nearest_bars(f"{path}/nearest.png", list(zip(labels[:8], np.linspace(0.9, 0.1, 8))), "nearest tokens")
    plots.image_overlays(f"{path}/image.png", RNG.random((8, 8, 1)), [("last layer", RNG.random((4, 4)))] * 2,
                         "attention over the patches of " + "a long source name " * 10 + "\npool='mean'")


def _overlapping(a, b) -> bool:
    return min(a.x1, b.x1) - max(a.x0, b.x0) > 1 and min(a.y1, b.y1) - max(a.y0, b.y0) > 1


def _tick_labels(axis):
    return [t for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]


@pytest.mark.parametrize("n", [8, 128])
def test_every_map_has_a_colour_bar_and_no_title_label_or_panel_overlaps_another_or_leaves_the_figure(
        figures, tmp_path, n):
    _draw_all(tmp_path, n)
    assert set(figures) == {"self.png", "cross.png", "layers.png", "lens.png", "temperature.png", "nearest.png",
                            "image.png"}
    for name, fig in figures.items():
        maps = [im for ax in fig.axes for im in ax.get_images() if im.get_cmap().name != "gray"]
        scales = {(im.get_cmap().name, im.get_clim()) for im in maps if im.colorbar is not None}
        assert all((im.get_cmap().name, im.get_clim()) in scales for im in maps), name  # the lens' strips share one
        assert bool(maps) == (name not in ("temperature.png", "nearest.png")), name
        renderer = fig.canvas.get_renderer()
        fig.draw_without_rendering()
        boxes = [(f"axes {i}", ax.get_tightbbox(renderer)) for i, ax in enumerate(fig.axes) if ax.axison]
        boxes += [(t.get_text()[:20], t.get_window_extent(renderer)) for t in fig.texts  # suptitle, supxlabel
                  if t.get_visible() and t.get_text()]
        for i, (a, box) in enumerate(boxes):
            assert box.x0 >= -1 and box.y0 >= -1 and box.x1 <= fig.bbox.x1 + 1 and box.y1 <= fig.bbox.y1 + 1, (
                name, a, box, fig.bbox)
            for b, other in boxes[i + 1:]:
                assert not _overlapping(box, other), (name, a, b)


@pytest.mark.parametrize("n", [8, 128])
def test_token_labels_are_thinned_to_a_legible_size_and_never_overlap(figures, tmp_path, n):
    _draw_all(tmp_path, n)
    for name, fig in figures.items():
        fig.draw_without_rendering()
        for ax in fig.axes:
            for axis in (ax.xaxis, ax.yaxis):
                shown = _tick_labels(axis)
                if not shown or not any(t.get_text().startswith(("tok", "src", "aaa")) for t in shown):
                    continue  # no token axis: a colour bar, a probability
                assert all(t.get_fontsize() >= plots.MIN_FONT for t in shown), name
                assert all(len(t.get_text()) <= plots.LABEL_CHARS for t in shown), name
                assert len(shown) <= 40, (name, len(shown))
                extents = [t.get_window_extent() for t in shown]
                assert not any(_overlapping(a, b) for a, b in zip(extents, extents[1:])), name
    heads = figures["self.png"].axes[0]
    assert len(_tick_labels(heads.yaxis)) == (n if n == 8 else len(range(0, n, plots.thinned(n, 4.5)[0])))
    assert len(_tick_labels(figures["temperature.png"].axes[0].yaxis)) == min(n, plots.MAX_BARS)
    lens = figures["lens.png"].axes
    assert sum(len(_tick_labels(ax.xaxis)) for ax in lens if ax.get_label() != "<colorbar>") == n


def test_thinning_keeps_every_token_while_it_fits_and_one_in_k_beyond():
    assert plots.thinned(8, 4.5) == (1, plots.MAX_FONT)
    step, size = plots.thinned(128, 4.5)
    assert step == 4 and plots.MIN_FONT <= size <= plots.MAX_FONT
    assert plots.shorten("abcdefghij", 5) == "ab…ij" and plots.shorten("abc", 5) == "abc"


def test_a_token_label_shows_spaces_control_bytes_and_pieces_of_characters():
    labels = probe.token_labels(tokenizers.ByteTokenizer(), [100, 32, 10, 9, 21, 13, 231])
    assert labels == ["d", "␣", "⏎", "⇥", "\\x15", "\\r", "<231>"]


def test_a_special_token_that_decodes_to_nothing_is_labelled_by_its_name():
    bpe = tokenizers.train_bpe(["aaa bbb aaa bbb"] * 10, vocab_size=280)
    bos, eos = bpe.special_id("[BOS]"), bpe.special_id("[EOS]")
    assert bpe.decode([bos]) == ""
    assert probe.token_labels(bpe, [bos, *bpe.encode("aaa"), eos]) == ["[BOS]", "aaa", "[EOS]"]
