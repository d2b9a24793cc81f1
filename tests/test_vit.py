"""The ViT family: pinned sizes, patches, the image loaders, batches and a run end to end."""

import gzip
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from conftest import REPO

from transformer import config as config_lib
from transformer import models
from transformer.data.images import batches, host_views, normalisation
from transformer.data.images import sources as image_sources
from transformer.data.images import splits as splits_lib
from transformer.layers.cross_entropy import token_losses as cross_entropy
from transformer.layers.embeddings import PatchEmbed
from transformer.models import summary, vit
from transformer.training import checks, loop, shapes
from transformer.training import metrics as metrics_lib

# Parameter counts per preset (b16: the ViT-B/16 classifier, 1000 classes, no pre-logits layer).
PINNED = {
    "tiny": 227_530,
    "ti16": 5_717_416,
    "s16": 22_050_664,
    "b16": 86_567_656,
    "l16": 304_326_632,
}

SMALL_VIT = [
    "model.num_layers=1", "model.d_model=16", "model.num_heads=2", "model.mlp_dim=32",
    "data.batch_size=64", "optim.warmup_steps=2", "train.steps=4", "train.log_every=2",
    "train.eval_every=2", "train.checkpoint_every=2",
]


@pytest.mark.parametrize("preset", sorted(vit.PRESETS))
def test_pinned_parameter_counts(preset):
    assert preset in PINNED, f"preset {preset!r} has no pinned parameter count"
    assert models.count_params(vit.default_model_config(preset)) == PINNED[preset]


def test_inspect_counts_b16_from_the_config_on_imagenet_shaped_data(tmp_path):
    np.savez(tmp_path / "imagenet.npz", x=np.zeros((2, 224, 224, 3), np.uint8), y=np.array([0, 999]))
    config = config_lib.load(os.path.join(REPO, f"configs/vit.py:b16,data.source={tmp_path / 'imagenet.npz'}"))
    rows = summary.parameter_table(shapes.resolved(config))
    assert sum(r.parameters for r in rows) == PINNED["b16"]
    assert {r.kind: r.shape for r in rows}["positions"] == (197, 768)


def small_model(**overrides):
    cfg = vit.default_model_config("tiny")
    cfg.update(num_layers=2, d_model=16, num_heads=2, mlp_dim=32)
    cfg.update(overrides)
    return vit.build(cfg)


@pytest.mark.parametrize("pool", vit.POOLS)
def test_logits_shape_and_pooling(pool):
    model = small_model(pool=pool, image_size=8, patch_size=4, channels=3, num_classes=7)
    x = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
    params = nn.unbox(model.init(jax.random.key(0), x)["params"])
    assert ("cls" in params) == (pool == "cls")
    assert params["pos_embed"]["embedding"].shape == (4 + (pool == "cls"), 16)
    logits = model.apply({"params": params}, x)
    assert logits.shape == (2, 7) and logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())


def test_patch_embed_is_a_strided_convolution():
    x = jax.random.normal(jax.random.key(1), (2, 8, 12, 3))
    embed = PatchEmbed(4, 5)
    params = nn.unbox(embed.init(jax.random.key(0), x)["params"])
    out = embed.apply({"params": params}, x)  # [B, P, D]
    kernel, bias = params["proj"]["kernel"], params["proj"]["bias"]  # [p, p, C, D]
    conv = jax.lax.conv_general_dilated(x, kernel, (4, 4), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(out, (conv + bias).reshape(2, 6, 5), atol=1e-5)


@pytest.mark.parametrize("overrides,match", [
    (dict(image_size=10, patch_size=4), "config.model.image_size=10 is not divisible by patch_size=4"),
    (dict(d_model=15), "config.model.d_model=15 is not divisible by num_heads=2"),
    (dict(pool="max"), "config.model.pool='max'"),
    (dict(bogus=1), "unknown config.model keys for the vit family: bogus"),
])
def test_inconsistent_model_config_fails_naming_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        small_model(**overrides)


# --- loaders: the same small arrays written in every supported format


@pytest.fixture
def arrays():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(12, 4, 4, 1), dtype=np.uint8)
    y = np.array([0, 1, 2] * 4, np.int64)
    return {"train": (x[:9], y[:9]), "test": (x[9:], y[9:])}


def by_label(x, y):
    order = np.argsort(y, kind="stable")
    return x[order], y[order]


def assert_same(got, expected):
    for split in ("train", "test"):
        np.testing.assert_array_equal(got[split][0], expected[split][0])
        np.testing.assert_array_equal(got[split][1], expected[split][1])


def write_idx(path, array: np.ndarray, magic: bytes | None = None):
    dims = b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    header = magic if magic is not None else bytes([0, 0, 0x08, array.ndim])
    with gzip.open(path, "wb") as f:
        f.write(header + dims + array.astype(np.uint8).tobytes())


def write_idx_dir(directory, arrays):
    os.makedirs(directory, exist_ok=True)
    for prefix, (x, y) in zip(("train", "t10k"), (arrays["train"], arrays["test"])):
        write_idx(os.path.join(directory, f"{prefix}-images-idx3-ubyte.gz"), x[..., 0])
        write_idx(os.path.join(directory, f"{prefix}-labels-idx1-ubyte.gz"), y)


def source(path, test_fraction=0.25):
    """The source's splits as arrays of their eval views at 4 x 4 x 1 (a folder indexed beside it)."""
    config = ml_collections.ConfigDict(dict(source=str(path), test_fraction=test_fraction, val_labels=""))
    splits = image_sources.load(config, os.path.join(os.path.dirname(str(path)), "run"))
    recipe = host_views.Recipe(image_size=4, channels=1)
    return {name: (np.stack([host_views.eval_view(split.read(i), recipe) for i in range(len(split))]),
                   np.asarray(split.labels)) for name, split in splits.items()}


def test_idx_files_load_with_their_split(tmp_path, arrays):
    write_idx_dir(tmp_path / "mnist", arrays)
    assert_same(source(tmp_path / "mnist"), arrays)


def test_npz_loads_with_and_without_a_test_split(tmp_path, arrays):
    (x, y), (xt, yt) = arrays["train"], arrays["test"]
    np.savez(tmp_path / "both.npz", x=x, y=y, x_test=xt, y_test=yt)
    assert_same(source(tmp_path / "both.npz"), arrays)
    np.savez(tmp_path / "one.npz", x=x[..., 0], y=y)
    got = source(tmp_path / "one.npz", test_fraction=1 / 3)
    assert_same(got, splits_lib.split(x, y, 1 / 3))
    assert len(got["test"][1]) == 3 and len(got["train"][1]) == 6


def test_image_folder_of_npy_with_train_and_test(tmp_path, arrays):
    for split, (x, y) in arrays.items():
        for i, (image, label) in enumerate(zip(x, y)):
            folder = tmp_path / "folder" / split / f"class_{'abc'[label]}"
            os.makedirs(folder, exist_ok=True)
            np.save(folder / f"{i:03d}.npy", image[..., 0] if i % 2 else image)
    expected = {s: by_label(*arrays[s]) for s in arrays}
    assert_same(source(tmp_path / "folder"), expected)


def test_image_folder_of_png_without_splits(tmp_path, arrays):
    image_module = pytest.importorskip("PIL.Image")
    x, y = arrays["train"]
    for i, (image, label) in enumerate(zip(x, y)):
        os.makedirs(tmp_path / "png" / str(label), exist_ok=True)
        image_module.fromarray(image[..., 0]).save(tmp_path / "png" / str(label) / f"{i:03d}.png")
    assert_same(source(tmp_path / "png", 1 / 3), splits_lib.split(*by_label(x, y), 1 / 3))


@pytest.mark.parametrize("magic,match", [(b"\x00\x00\x07\x03", "bad IDX magic number 00000703"),
                                         (b"\x08\x03\x00\x00", "bad IDX magic number")])
def test_malformed_idx_fails_naming_the_file(tmp_path, arrays, magic, match):
    write_idx_dir(tmp_path, arrays)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", arrays["train"][0][..., 0], magic=magic)
    with pytest.raises(ValueError, match=f"train-images-idx3-ubyte.gz: {match}"):
        source(tmp_path)


def test_idx_with_a_short_body_fails_naming_the_file(tmp_path, arrays):
    write_idx_dir(tmp_path, arrays)
    with gzip.open(tmp_path / "t10k-labels-idx1-ubyte.gz", "wb") as f:
        f.write(bytes([0, 0, 8, 1]) + (5).to_bytes(4, "big") + b"\x01\x02")
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.gz: IDX header says shape"):
        source(tmp_path)


def test_npz_without_y_fails_naming_the_file(tmp_path, arrays):
    np.savez(tmp_path / "bad.npz", x=arrays["train"][0])
    with pytest.raises(ValueError, match="bad.npz: missing array"):
        source(tmp_path / "bad.npz")


# --- batches


def digits_data(rows=None, **recipe):
    source = image_sources.load(ml_collections.ConfigDict(dict(source="digits", test_fraction=0.2)), "")
    return batches.ImageData(source, host_views.Recipe(8, 1, **recipe), batch_size=64, seed=3, rows=rows)


AUGMENTED = dict(crop_padding=2, flip=True)


def test_train_batches_are_a_pure_function_of_seed_and_step():
    a, b = digits_data(**AUGMENTED), digits_data(**AUGMENTED)
    for step in (0, 7, 100):
        np.testing.assert_array_equal(a.train_batch(step)["images"], b.train_batch(step)["images"])
    assert not np.array_equal(a.train_batch(1)["labels"], a.train_batch(2)["labels"])
    batch = a.train_batch(0)
    assert batch["images"].dtype == np.uint8 and batch["images"].shape == (64, 8, 8, 1)
    assert batch["labels"].dtype == np.int32 and not batch["replaced"].any()


def test_an_epoch_visits_every_train_image_once_and_processes_split_the_batch():
    data = digits_data()
    n = len(data.splits["train"])
    seen = np.concatenate([data.train_indices(s) for s in range(n // 64)])
    assert len(np.unique(seen)) == len(seen)
    parts = [np.arange(0, 64, 2), np.arange(1, 64, 2)]  # the rows of two processes, interleaved
    for recipe in ({}, AUGMENTED):
        whole = digits_data(**recipe).train_batch(5)
        for rows in parts:
            half = digits_data(rows=rows, **recipe).train_batch(5)
            for key in ("images", "labels"):
                np.testing.assert_array_equal(half[key], whole[key][rows])


def test_sampled_statistics_of_a_small_split_are_the_whole_splits_and_eval_covers_the_test_split():
    data = digits_data()
    mean, std = data.sampled_statistics(10_000)
    x = normalisation.normalise(data.splits["train"].x, mean, std)
    np.testing.assert_allclose(x.mean(axis=(0, 1, 2)), 0.0, atol=1e-4)
    np.testing.assert_allclose(x.std(axis=(0, 1, 2)), 1.0, atol=1e-4)
    assert len(normalisation.statistics_rows(1438, 100)) == 100
    evals = list(data.eval_batches())
    assert sum(float(b["weights"].sum()) for b in evals) == len(data.splits["test"]) == 359
    assert all(len(b["labels"]) == 64 for b in evals)
    np.testing.assert_array_equal(np.concatenate([b["labels"] for b in evals])[:359], data.splits["test"].labels)


# --- a run end to end


def test_training_writes_accuracy_and_a_restored_checkpoint_evaluates_the_same(tmp_path):
    config = config_lib.load(os.path.join(REPO, "configs/vit.py:tiny"), SMALL_VIT)
    last = loop.train(config, str(tmp_path))
    all_recs = metrics_lib.read(str(tmp_path / "metrics.jsonl"))
    recs = [r for r in all_recs if "eval/accuracy" in r]
    assert [r["step"] for r in recs] == [2, 4]
    assert {"eval/loss", "eval/majority_accuracy"} <= set(recs[-1])
    assert {"train/accuracy", "train/images_per_s"} <= set(all_recs[0])
    assert 0.0 <= recs[-1]["eval/accuracy"] <= 1.0 and last["eval/accuracy"] == recs[-1]["eval/accuracy"]
    run = loop.setup(checks.checked(config), str(tmp_path))
    assert int(run.state.step) == 4
    restored = loop.evaluate(run, run.state.params)
    assert restored == pytest.approx({k: v for k, v in recs[-1].items() if k.startswith("eval/")}, rel=1e-6)
    run.ckpt.close()
    run.writer.close()


def test_label_smoothing_moves_mass_off_the_label():
    logits = jnp.array([[4.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    labels = jnp.array([0, 2])
    plain = cross_entropy(logits, labels)
    np.testing.assert_allclose(plain, optax.softmax_cross_entropy_with_integer_labels(logits, labels), rtol=1e-5)
    smoothed = cross_entropy(logits, labels, 0.3)
    assert smoothed[0] > plain[0] and smoothed[1] < plain[1]
