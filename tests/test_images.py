"""Images at scale, at CI size: folders indexed and read by worker processes, the ViT/DeiT recipe,
unreadable files, and runs from folders (the large checks: experiments/images/)."""

import math
import os
import pickle
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import REPO
from PIL import Image

from transformer import config as config_lib
from transformer import rundir
from transformer.data.images import batches, device_views, host_views, normalisation
from transformer.data.images import sources as image_sources
from transformer.data.images import splits as splits_lib
from transformer.layers.block import Block, make_blocks
from transformer.training import checks, loop, shapes
from transformer.training import metrics as metrics_lib
from transformer.training.tasks import image_classification


def write_folder(root, n=60, size=16, seed=0, layout="flat") -> tuple[np.ndarray, np.ndarray]:
    """n random RGB PNGs in 3 class folders (layout 'flat': ROOT/CLASS/*, 'splits': ROOT/train + ROOT/val);
    returns the images [n, size, size, 3] and labels in the index's order (class, then file name)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    y = np.arange(n) % 3
    for i in range(n):
        split = "" if layout == "flat" else ("val" if i % 5 == 0 else "train")
        folder = os.path.join(root, split, f"class_{y[i]}")
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(x[i]).save(os.path.join(folder, f"{i:04d}.png"))
    order = np.lexsort((np.arange(n), y))
    return x[order], y[order]


def folder_data(root, workdir, recipe: host_views.Recipe, workers=0, rows=None, batch_size=8, test_fraction=0.25):
    config = ml_collections.ConfigDict(dict(source=str(root), test_fraction=test_fraction, val_labels=""))
    return batches.ImageData(image_sources.load(config, str(workdir)), recipe, batch_size, seed=1, rows=rows,
                             workers=workers)


FULL = host_views.Recipe(16, 3, random_resized_crop=True, flip=True, rand_augment_ops=2, crop_padding=1)


def test_a_folder_is_indexed_once_and_reads_its_files_as_an_npz_of_them_would(tmp_path):
    x, y = write_folder(tmp_path / "folder")
    splits = image_sources.load(ml_collections.ConfigDict(dict(source=str(tmp_path / "folder"), test_fraction=0.25,
                                                               val_labels="")), str(tmp_path / "run"))
    assert sorted(os.listdir(tmp_path / "run" / "images")) == [
        "index.json", "test_labels.npy", "test_paths.npy", "train_labels.npy", "train_paths.npy"]
    expected = splits_lib.split(x, y, 0.25)
    for name, split in splits.items():
        assert isinstance(split, splits_lib.FileSplit)
        np.testing.assert_array_equal(np.stack([split.read(i) for i in range(len(split))]), expected[name][0])
        np.testing.assert_array_equal(split.labels, expected[name][1])
    os.remove(tmp_path / "folder" / "class_0" / "0000.png")  # the index is not rebuilt: the file counts as unreadable
    again = image_sources.load(ml_collections.ConfigDict(dict(source=str(tmp_path / "folder"), test_fraction=0.25,
                                                              val_labels="")), str(tmp_path / "run"))
    assert len(again["train"]) + len(again["test"]) == 60


def test_train_and_val_folders_and_imagenets_flat_val_with_a_labels_file(tmp_path):
    write_folder(tmp_path / "imagenet", layout="splits")
    config = ml_collections.ConfigDict(dict(source=str(tmp_path / "imagenet"), test_fraction=0.25, val_labels=""))
    splits = image_sources.load(config, str(tmp_path / "run"))
    assert (len(splits["train"]), len(splits["test"])) == (48, 12)
    flat = tmp_path / "imagenet" / "val"
    lines = ["ImageId,PredictionString"]
    for folder in sorted(os.listdir(flat)):
        for f in sorted(os.listdir(flat / folder)):
            os.rename(flat / folder / f, flat / f)
            lines.append(f"{os.path.splitext(f)[0]},{folder} 1 2 3 4")
        os.rmdir(flat / folder)
    (tmp_path / "LOC_val_solution.csv").write_text("\n".join(lines) + "\n")
    config.val_labels = str(tmp_path / "LOC_val_solution.csv")
    flat_splits = image_sources.load(config, str(tmp_path / "run2"))
    by_name = lambda s: sorted((os.path.basename(s.name(i)), int(s.labels[i])) for i in range(len(s)))  # noqa: E731
    assert by_name(flat_splits["test"]) == by_name(splits["test"])
    (tmp_path / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n0000,class_0\n")
    with pytest.raises(ValueError, match="no label for 11 file"):
        image_sources.load(config, str(tmp_path / "run3"))


def test_worker_processes_make_the_batches_the_calling_thread_makes_and_processes_split_them(tmp_path):
    write_folder(tmp_path / "folder")
    inline = folder_data(tmp_path / "folder", tmp_path / "run", FULL)
    pooled = folder_data(tmp_path / "folder", tmp_path / "run", FULL, workers=2)
    for step in (0, 3, 11):  # past an epoch of 45 train images
        a, b = inline.train_batch(step), pooled.train_batch(step)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
        assert a["images"].dtype == np.uint8 and a["images"].shape == (8, 16, 16, 3)
    rows = np.array([1, 4, 6])
    half = folder_data(tmp_path / "folder", tmp_path / "run", FULL, workers=2, rows=rows).train_batch(3)
    np.testing.assert_array_equal(half["images"], inline.train_batch(3)["images"][rows])
    evals = [list(d.eval_batches()) for d in (inline, pooled)]
    assert sum(float(b["weights"].sum()) for b in evals[0]) == 15
    for a, b in zip(*evals):
        np.testing.assert_array_equal(a["images"], b["images"])


def test_an_unreadable_image_is_replaced_named_once_and_counted(tmp_path, capfd):
    write_folder(tmp_path / "folder", n=30)
    data = folder_data(tmp_path / "folder", tmp_path / "run", host_views.Recipe(16, 3), batch_size=30,
                       test_fraction=0.0 + 1 / 30)
    train = data.splits["train"]
    bad = train.name(3)
    with open(bad, "r+b") as f:  # a truncated file: its first bytes only
        f.truncate(60)
    first, second = data.train_batch(0), data.train_batch(1)
    for batch in (first, second):
        row = list(data.train_indices(0 if batch is first else 1)).index(3)
        assert batch["replaced"][row] == 1 and batch["replaced"].sum() == 1
        np.testing.assert_array_equal(batch["images"][row], np.asarray(train.read(4)))
    err = capfd.readouterr().err
    assert err.count(bad) == 1 and "replaced by the next image" in err
    assert data.replaced == 2


def test_train_views_have_the_models_shape_and_stay_in_place_without_augmentation():
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8))
    for recipe in (FULL, host_views.Recipe(16, 1, random_resized_crop=True, rand_augment_ops=3)):
        for seed in range(5):
            view = host_views.train_view(image, recipe, np.random.default_rng(seed))
            assert view.shape == (16, 16, recipe.channels) and view.dtype == np.uint8
    small = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    np.testing.assert_array_equal(host_views.train_view(small, host_views.Recipe(16, 3), rng), small)
    flipped = host_views.train_view(small, host_views.Recipe(16, 3, flip=True), np.random.default_rng(1))
    assert np.array_equal(flipped, small) or np.array_equal(flipped, small[:, ::-1])
    assert host_views.eval_view(image, host_views.Recipe(16, 3, crop_fraction=0.875)).shape == (16, 16, 3)
    for name, op in host_views.RAND_AUGMENT.items():
        assert op(image, 0.9, np.random.default_rng(0)).size == image.size, name
    for seed in range(20):
        left, top, w, h = host_views.crop_box(60, 40, (0.08, 1.0), (3 / 4, 4 / 3), np.random.default_rng(seed))
        assert 0 <= left and left + w <= 60 and 0 <= top and top + h <= 40 and w * h >= 1


@pytest.mark.parametrize("mixup,cutmix", [(0.8, 0.0), (0.0, 1.0), (0.8, 1.0)])
def test_mixup_and_cutmix_mix_images_and_targets_alike(mixup, cutmix):
    x = jnp.stack([jnp.full((8, 8, 1), float(i)) for i in range(4)])  # image i is all i
    targets = jax.nn.one_hot(jnp.arange(4), 4)
    for seed in range(4):
        mixed, soft = image_classification.mix(x, targets, jax.random.key(seed), mixup, cutmix, 0.5)
        np.testing.assert_allclose(soft.sum(-1), 1.0, rtol=1e-6)
        kept = soft[0, 0]  # row 0 is mixed with row 3: its target keeps `kept` of class 0
        np.testing.assert_allclose(soft[0, 3], 1 - kept, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(mixed[0].mean(), 3 * (1 - kept), rtol=1e-4, atol=1e-5)  # the pixels agree
        if not mixup:  # cutmix: each pixel is one image's or the other's
            assert set(np.unique(np.asarray(mixed[0]))) <= {0.0, 3.0}


def test_drop_path_grows_with_depth_drops_whole_branches_per_example_and_is_off_at_eval():
    blocks = make_blocks("block", 3, drop_path=0.5, num_heads=2, head_dim=4, mlp_dim=8)
    assert [b.drop_path for b in blocks] == [0.0, 0.25, 0.5]
    block, plain = Block(num_heads=2, head_dim=4, mlp_dim=8, drop_path=0.5), Block(num_heads=2, head_dim=4, mlp_dim=8)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 5, 8)), jnp.float32)  # [B, L, D]
    params = plain.init(jax.random.key(0), x)
    np.testing.assert_array_equal(block.apply(params, x), plain.apply(params, x))
    out = block.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    untouched = np.asarray((out == x).all(axis=(1, 2)))  # both branches dropped: about 1 in 4
    assert 5 < untouched.sum() < 30
    with pytest.raises(ValueError, match="config.model.drop_path grows with depth"):
        checks.validate(config_lib.load(os.path.join(REPO, "configs/vit.py:tiny"),
                                        ["model.drop_path=0.1", "model.scan_layers=True"]))


FOLDER_RUN = ["model.image_size=16", "model.patch_size=4", "model.channels=3", "model.num_layers=2",
              "model.d_model=16", "model.num_heads=2", "model.mlp_dim=32", "model.num_classes=3",
              "data.batch_size=8", "data.test_fraction=0.25", "optim.warmup_steps=2", "train.steps=6",
              "train.log_every=1", "train.eval_every=6", "train.checkpoint_every=3"]
RECIPE = ["data.augment.random_resized_crop=True", "data.augment.flip=True", "data.augment.rand_augment_ops=2",
          "data.augment.mixup_alpha=0.8", "data.augment.cutmix_alpha=1.0", "model.drop_path=0.1",
          "train.label_smoothing=0.1", "data.workers=2"]


def losses_of(workdir) -> dict:
    return {r["step"]: r["train/loss"] for r in metrics_lib.read(os.path.join(workdir, "metrics.jsonl"))
            if "train/loss" in r}


def test_a_vit_takes_its_classes_channels_and_image_size_from_the_folder_and_keeps_them_on_resume(tmp_path, capsys):
    write_folder(tmp_path / "folder", n=24, size=40)  # 3 classes of RGB 40 x 40 images
    spec = os.path.join(REPO, f"configs/vit.py:tiny,data.source={tmp_path / 'folder'}")
    small = ["model.num_layers=1", "model.d_model=16", "model.num_heads=2", "model.mlp_dim=32", "data.batch_size=8",
             "data.workers=0", "train.steps=1", "train.log_every=1", "train.eval_every=1", "train.checkpoint_every=1"]
    loop.train(config_lib.load(spec, small), str(tmp_path / "run"))
    said = capsys.readouterr().err.splitlines()
    assert said[:2] == [f"data: {tmp_path / 'folder'}: 3 classes, RGB 40 x 40 images",
                        "from the data: model.num_classes=3, model.channels=3, model.image_size=40 (image_size: the "
                        "images' median side, 40, to the nearest multiple of patch_size=2; at most 224 and 24 patches "
                        "a side)"]
    saved = rundir.open(str(tmp_path / "run")).config
    assert (saved.model.num_classes, saved.model.channels, saved.model.image_size) == (3, 3, 40)
    loop.train(rundir.resumed_config(str(tmp_path / "run"), {"train.steps": "2"}), str(tmp_path / "run"))
    assert rundir.open(str(tmp_path / "run")).latest_step == 2 and "from the data" not in capsys.readouterr().err

    with pytest.raises(ValueError, match=r"^config.model.num_classes=2 but .* holds 3 classes: raise it, or leave"):
        checks.validate(config_lib.load(spec, ["model.num_classes=2"]))
    assert shapes.resolve(config_lib.load(spec, ["model.channels=1", "model.image_size=8"])) == [
        f"data: {tmp_path / 'folder'}: 3 classes, RGB 40 x 40 images",
        f"config.model.channels=1: {tmp_path / 'folder'}'s images are RGB, read as grayscale",
        f"config.model.image_size=8: {tmp_path / 'folder'}'s images are typically 40 px a side, viewed at 8 x 8",
        "from the data: model.num_classes=3"]
    with pytest.raises(ValueError, match="config.model.channels=3 but digits holds 1-channel images"):
        checks.validate(config_lib.load(os.path.join(REPO, "configs/vit.py:tiny"), ["model.channels=3"]))


@pytest.mark.parametrize("typical, patch, side", [(8, 2, 8), (28, 4, 28), (40, 16, 48), (375, 16, 224), (500, 2, 48),
                                                  (5, 16, 16)])
def test_the_image_size_from_the_data_is_the_typical_side_to_a_patch_multiple_within_bounds(typical, patch, side):
    assert image_classification.image_side(typical, patch) == side


@pytest.mark.slow
def test_replaced_images_are_a_count_summed_over_the_logged_steps(tmp_path):
    write_folder(tmp_path / "folder", n=40)
    config = config_lib.load(os.path.join(REPO, f"configs/vit.py:tiny,data.source={tmp_path / 'folder'}"),
                             [*FOLDER_RUN, "train.log_every=3", "data.workers=0", "data.statistics_sample=8"])
    splits = image_sources.load(config.data, str(tmp_path / "run"))
    data = batches.ImageData(splits, host_views.Recipe(16, 3), 8, config.train.seed)
    bad = int(data.train_indices(0)[0])  # held by the first step's batch, so the first window counts it
    with open(splits["train"].name(bad), "r+b") as f:
        f.truncate(60)
    loop.train(config, str(tmp_path / "run"), devices=jax.devices()[:1])
    logged = {r["step"]: r["train/replaced_images_since_last_log"]
              for r in metrics_lib.read(str(tmp_path / "run" / "metrics.jsonl")) if "train/loss" in r}
    held = [int((data.train_indices(step) == bad).sum()) for step in range(6)]
    assert logged == {3: sum(held[:3]), 6: sum(held[3:])} and logged[3] >= 1


@pytest.mark.slow
def test_a_run_from_a_folder_has_the_losses_of_one_from_an_npz_of_its_images(tmp_path):
    x, y = write_folder(tmp_path / "folder")
    np.savez(tmp_path / "same.npz", x=x, y=y)
    runs = {}
    for name, src in (("folder", tmp_path / "folder"), ("npz", tmp_path / "same.npz")):
        config = config_lib.load(os.path.join(REPO, f"configs/vit.py:tiny,data.source={src}"), FOLDER_RUN)
        last = loop.train(config, str(tmp_path / f"run-{name}"))
        runs[name] = losses_of(tmp_path / f"run-{name}")
        assert {"eval/top5_accuracy", "eval/replaced_images"} <= set(last) and last["eval/top5_accuracy"] == 1.0
    assert runs["folder"] == runs["npz"] and len(runs["folder"]) == 6


@pytest.mark.slow
@pytest.mark.parametrize("source", ["folder", "npz"])  # the views made on the host; on the device
def test_a_run_stopped_and_resumed_with_every_augmentation_on_has_the_uninterrupted_losses(tmp_path, source):
    views = [f"data.augment.views={'host' if source == 'folder' else 'device'}"]
    x, y = write_folder(tmp_path / "folder")
    np.savez(tmp_path / "images.npz", x=x, y=y)
    path = tmp_path / ("folder" if source == "folder" else "images.npz")
    spec = os.path.join(REPO, f"configs/vit.py:tiny,data.source={path}")
    loop.train(config_lib.load(spec, [*FOLDER_RUN, *RECIPE, *views]), str(tmp_path / "whole"))
    loop.train(config_lib.load(spec, [*FOLDER_RUN, *RECIPE, *views, "train.stop_at=3"]), str(tmp_path / "parts"))
    assert sorted(losses_of(tmp_path / "parts")) == [1, 2, 3]
    loop.train(config_lib.load(spec, [*FOLDER_RUN, *RECIPE, *views]), str(tmp_path / "parts"))
    whole, parts = losses_of(tmp_path / "whole"), losses_of(tmp_path / "parts")
    assert sorted(whole) == sorted(parts) == list(range(1, 7))
    np.testing.assert_allclose([parts[s] for s in whole], list(whole.values()), rtol=1e-6)
    saved = normalisation.saved_statistics(str(tmp_path / "whole"))
    assert saved is not None and saved[0].shape == (3,)


@pytest.mark.parametrize("override,match", [
    ("data.crop_fraction=0", "config.data.crop_fraction=0"),
    ("data.augment.mixup_alpha=-1", "config.data.augment.mixup_alpha=-1"),
    ("data.augment.scale=(0.5,0.1)", "config.data.augment.scale"),
    ("data.mean=(1.0,2.0)", "config.data.mean=.* one value per channel"),
    ("data.mean=(1.0,)", "config.data.mean and config.data.std are given together"),
    ("data.augment.mix_switch=2.0", "config.data.augment.mix_switch=2.0 must be in"),
])
def test_bad_image_settings_fail_naming_the_key(override, match):
    with pytest.raises(ValueError, match=match):
        checks.validate(config_lib.load(os.path.join(REPO, "configs/vit.py:tiny"), [override]))


def test_workers_import_neither_jax_nor_the_launching_script_and_a_dead_worker_is_explained(tmp_path):
    write_folder(tmp_path / "folder", n=12)
    script = tmp_path / "launch.py"  # run as __main__ by path, importing jax, as `python -m transformer.train` does
    script.write_text(f"""import sys, jax
print("launched", flush=True)
from transformer.data.images import batches, host_views, sources as image_sources
import ml_collections
config = ml_collections.ConfigDict(dict(source={str(tmp_path / 'folder')!r}, test_fraction=0.25, val_labels=""))
data = batches.ImageData(image_sources.load(config, {str(tmp_path / 'run')!r}), host_views.Recipe(16, 3), 4, 0,
                         workers=1)
print(data.pool.submit(eval, "sorted(m for m in ('jax', 'flax') if m in __import__('sys').modules)")
      .result())
""")
    import subprocess
    import sys
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["launched", "[]"]  # the worker did not run the script
    data = folder_data(tmp_path / "folder", tmp_path / "run", host_views.Recipe(16, 3), workers=1, batch_size=4)
    for process in list(data.pool._processes.values()):
        process.kill()
        process.join()
    with pytest.raises(RuntimeError, match="a data worker process died .* lower config.data.workers"):
        data.train_batch(0)


def test_fixed_statistics_can_be_given_inside_the_config_argument():
    config = config_lib.load(os.path.join(REPO, "configs/vit.py:tiny,model.channels=3,data.mean=(1.0,2.0,3.0),"
                                                "data.std=(4.0,5.0,6.0)"))
    assert tuple(config.data.mean) == (1.0, 2.0, 3.0) and tuple(config.data.std) == (4.0, 5.0, 6.0)


def test_device_views_apply_the_recipes_operations_as_pil_does():
    """Each RandAugment operation on the device against host_views.py's (PIL's): the geometric and integer ones
    pixel for pixel, the enhancements within rounding; resizing within a grey level on average."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)

    class Plus:  # host_views.py draws a sign with rng.random() < 0.5: always +
        def random(self):
            return 0.0

    for name in host_views.OPS:
        ours = np.asarray(device_views._round(device_views.OPERATIONS[name](jnp.asarray(image, jnp.float32), 0.9, 1.0)))
        theirs = np.asarray(host_views.RAND_AUGMENT[name](Image.fromarray(image), 0.9, Plus()), np.float32)
        mean_difference = np.abs(ours - theirs).mean()
        assert mean_difference <= (0.5 if name in ("brightness", "color", "contrast", "sharpness") else 0), name
    wide = rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)
    resized = device_views._resize(jnp.asarray(wide, jnp.float32), jnp.asarray([5.0, 3.0, 30.0, 20.0]), 32)
    pil = np.asarray(Image.fromarray(wide).resize((32, 32), Image.BILINEAR, box=(5, 3, 35, 23)), np.float32)
    assert np.abs(np.asarray(resized) - pil).mean() < 1
    recipe = host_views.Recipe(32, 3, crop_fraction=0.875)
    eval_crop = device_views.eval_views(jnp.asarray(wide[None]), recipe)[0]
    assert np.abs(np.asarray(eval_crop) - host_views.eval_view(wide, recipe)).mean() < 1


def test_device_views_are_a_pure_function_of_seed_and_example():
    """Keyed by (seed, step, row): a half batch (another process's rows) has the same views as the whole
    batch's rows, another step other views; no augmentation leaves an S x S image as it is."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.integers(0, 256, (8, 24, 20, 3), dtype=np.uint8))
    example = jnp.stack([jnp.full(8, 5), jnp.arange(8)], axis=1).astype(jnp.int32)
    views = jax.jit(lambda x, e: device_views.train_views(x, e, FULL, 7))
    whole = views(x, example)
    assert whole.shape == (8, 16, 16, 3) and bool(jnp.all((whole == jnp.round(whole)) & (whole >= 0) & (whole <= 255)))
    np.testing.assert_array_equal(views(x[3:6], example[3:6]), whole[3:6])
    assert not np.array_equal(views(x, example.at[:, 0].set(6)), whole)
    square = x[:, :16, :16]
    np.testing.assert_array_equal(device_views.train_views(square, example, host_views.Recipe(16, 3), 7), square)
    flipped = device_views.train_views(square, example, host_views.Recipe(16, 3, flip=True), 7)
    for view, image in zip(np.asarray(flipped), np.asarray(square)):
        assert np.array_equal(view, image) or np.array_equal(view, image[:, ::-1])


def test_in_memory_images_reach_worker_processes_through_shared_memory(tmp_path):
    """Host views from an .npz by 2 workers are the calling thread's; the split travels by name, not bytes."""
    x, y = np.random.default_rng(2).integers(0, 256, (40, 20, 20, 3), dtype=np.uint8), np.arange(40) % 3
    np.savez(tmp_path / "images.npz", x=x, y=y)
    config = ml_collections.ConfigDict(dict(source=str(tmp_path / "images.npz"), test_fraction=0.25, val_labels=""))
    made = [batches.ImageData(image_sources.load(config, str(tmp_path)), FULL, 8, seed=1, workers=w) for w in (0, 2)]
    for step in (0, 4):
        a, b = (data.train_batch(step) for data in made)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert len(pickle.dumps(made[1].splits["train"])) < 2000


@pytest.mark.slow
def test_a_vit_step_on_device_views_draws_no_random_bits_over_activations_with_threefry(tmp_path):
    """DeiT's recipe with dropout: the lowered step's threefry runs on keys and per-example draws only
    (at most 16 words an example); dropout's bits come from XLA's RngBitGenerator."""
    np.savez(tmp_path / "images.npz", x=np.random.default_rng(0).integers(0, 256, (64, 40, 40, 3), dtype=np.uint8),
             y=np.arange(64) % 10)
    config = config_lib.load(os.path.join(REPO, f"configs/vit.py:s16,data.source={tmp_path / 'images.npz'}"), [
        "model.image_size=32", "model.patch_size=8", "model.num_layers=2", "model.d_model=32", "model.num_heads=2",
        "model.mlp_dim=64", "model.num_classes=10", "data.batch_size=16", "model.dropout=0.1",
        "data.augment.views=device"])
    run = loop.setup(checks.checked(config), str(tmp_path / "run"))
    try:
        assert run.task.on_device
        text = run.train_step.trace(run.state, run.place(run.task.train_batch(0)), run.step_rng).lower().as_text()
    finally:
        run.ckpt.close()
        run.writer.close()
    words = [math.prod(int(d) for d in shape.split("x")[:-1] if d) for shape in
             re.findall(r"call @threefry2x32\w*\(.*?\) -> \(tensor<([\dx]*ui32)>", text)]
    assert words and max(words) <= 16 * 16, max(words)
    assert "rng_bit_generator" in text
