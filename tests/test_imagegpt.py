"""ImageGPT: the palette tokenizer, a GPT run on pixels, its completions and its linear probe."""

import os

import numpy as np
import pytest
from conftest import REPO

from transformer import config as config_lib
from transformer import probe, rundir
from transformer.data.images import palette, pixels
from transformer.inference import images as image_completion
from transformer.probe import linear
from transformer.training import checks, loop, shapes
from transformer.training import metrics as metrics_lib

SMALL_IGPT = ["model.num_layers=2", "model.d_model=32", "model.num_heads=2", "model.mlp_dim=64",
              "data.image_side=6", "data.seq_len=36", "model.max_len=36", "data.palette_size=4",
              "data.batch_size=8", "data.eval_batches=2", "data.eval_fraction=0.25", "train.steps=3",
              "train.eval_every=3", "train.checkpoint_every=3", "train.log_every=1", "train.sample_tokens=36"]
LEVELS = np.array([0, 90, 170, 255], np.uint8)


def image_config(*overrides):
    return config_lib.load(os.path.join(REPO, "configs/gpt.py:igpt-tiny"), [*SMALL_IGPT, *overrides])


def two_classes(path, n=96, side=6):
    """An .npz of n grey images of two classes: a bright upper or lower half, in 4 levels."""
    rng = np.random.default_rng(0)
    y = np.arange(n) % 2
    x = LEVELS[rng.integers(0, 2, (n, side, side))]  # [N, S, S]
    for i in range(n):
        rows = slice(0, side // 2) if y[i] else slice(side // 2, side)
        x[i, rows] = LEVELS[rng.integers(2, 4, (side // 2, side))]
    np.savez(path, x=x, y=y)
    return str(path)


def test_palette_fit_encode_decode_round_trip(tmp_path):
    colours = np.array([[0, 0, 0], [255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 255]], np.uint8)
    images = colours[np.random.default_rng(0).integers(0, 5, (10, 4, 4))]  # [N, S, S, 3]
    exact = palette.fit(images, 5)
    np.testing.assert_array_equal(exact.decode(exact.encode(images)), images)
    assert exact.vocab_size == 6 and exact.sos_id == 5 and exact.special_id("[SOS]") == 5
    exact.save(str(tmp_path))
    assert palette.is_saved(str(tmp_path)) and not palette.is_saved(str(tmp_path / "none"))
    loaded = palette.load(str(tmp_path))
    np.testing.assert_array_equal(loaded.colours, exact.colours)
    noisy = np.clip(images.astype(int) + np.random.default_rng(1).integers(-20, 21, images.shape), 0, 255)
    fitted = palette.fit(noisy.astype(np.uint8), 5)  # k-means finds the five colours again
    ids = fitted.encode(noisy.astype(np.uint8))
    assert ids.shape == (10, 4, 4) and ids.max() < 5
    assert np.abs(fitted.decode(ids).astype(int) - images.astype(int)).max() <= 20
    assert len(palette.fit(images, 16).colours) == 5  # fewer colours than asked: the palette is those
    assert palette.unigram_entropy(np.array([0, 1, 0, 1]), 3) == pytest.approx(np.log(2))


def test_an_image_source_selects_pixels_and_says_palette_side_and_length(tmp_path):
    assert pixels.is_image_source("digits") and not pixels.is_image_source("stdlib")
    config = image_config()
    lines = shapes.resolve(config)
    assert "viewed at 6 x 6" in lines[0] and "palette of at most 4 colours" in lines[0] and "36 pixels" in lines[0]
    assert config.model.vocab_size == 5 and config.data.tokenizer == "palette"
    other_side = image_config("data.image_side=8")  # seq_len 36 and max_len 36 given: the side's 64 taken
    said = checks.checked(other_side).said
    assert (other_side.data.seq_len, other_side.model.max_len) == (64, 64)
    assert "from data.image_side=8: data.seq_len=64, model.max_len=64 (a row is one image's pixels)" in said


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("igpt")
    source = two_classes(tmp / "two.npz")
    workdir = str(tmp / "run")
    config = shapes.resolved(image_config(f"data.source={source}"))
    return workdir, loop.train(config, workdir)


def test_a_three_step_run_reports_nats_per_pixel_and_the_unigram_entropy(image_run):
    workdir, last = image_run
    assert {"eval/loss", "eval/bits_per_pixel", "eval/unigram_entropy"} <= set(last)
    assert np.isfinite(last["eval/loss"]) and 0 < last["eval/unigram_entropy"] <= np.log(4) + 1e-6
    assert os.path.isfile(os.path.join(workdir, "samples", "completions-3.png"))
    assert rundir.open(workdir).tokenizer().kind == "palette"
    assert any("eval/loss" in r for r in metrics_lib.read(os.path.join(workdir, "metrics.jsonl")))


def test_generate_images_keeps_the_upper_half_and_writes_a_png(image_run, tmp_path):
    workdir, _ = image_run
    run = rundir.open(workdir)
    tokenizer, images = run.tokenizer(), pixels.open_views(run.config, workdir)["test"][0][:3]
    completed = image_completion.complete(run.model(), run.restore_params(), tokenizer, images, samples=2)
    assert completed.shape == (3, 2, 6, 6, 1)
    kept = tokenizer.decode(tokenizer.encode(images))[:, None, :3]
    np.testing.assert_array_equal(completed[:, :, :3], np.broadcast_to(kept, completed[:, :, :3].shape))
    from PIL import Image
    for i, image in enumerate(images):
        Image.fromarray(image[..., 0]).resize((12, 12)).save(tmp_path / f"{i}.png")  # resized back to 6
    out = image_completion.complete_files(run, str(tmp_path), str(tmp_path / "grid.png"), samples=2)
    assert out == str(tmp_path / "grid.png") and os.path.getsize(out) > 1000
    with pytest.raises(ValueError, match="neither an image file nor a folder"):
        image_completion.complete_files(run, str(tmp_path / "missing.png"))


def test_the_linear_probe_scores_every_layer_and_raw_pixels(image_run, tmp_path):
    workdir, _ = image_run
    result = linear.probe(probe.load(workdir))
    assert result["layers"] == ["embedding", "block 1", "block 2"]
    assert all(0 <= a <= 1 for a in result["accuracy"]) and result["pixels"] > 0.9  # the halves are separable
    assert "| raw pixels |" in linear.table(result, 3)
    assert os.path.isfile(linear.figure(str(tmp_path / "linear.png"), result, "t"))


def test_a_palette_larger_than_the_images_colours_takes_theirs_and_says_so(tmp_path, capsys):
    images = LEVELS[np.random.default_rng(0).integers(0, 4, (10, 6, 6, 1))]  # 4 greys, palette_size 16
    config = image_config("data.palette_size=16")
    tokenizer = pixels.run_palette(config, str(tmp_path), images, show=True)
    assert len(tokenizer.colours) == 4 and tokenizer.sos_id == 4
    assert "hold 4 distinct colours, fewer than config.data.palette_size=16: the palette is those 4 (ids 5..16 " \
           "stay unused" in capsys.readouterr().err
    assert len(pixels.run_palette(config, str(tmp_path), images).colours) == 4  # read back on a resume
    with pytest.raises(ValueError, match="a palette of 4 colours, more than config.data.palette_size=3"):
        pixels.run_palette(image_config("data.palette_size=3"), str(tmp_path), images)
