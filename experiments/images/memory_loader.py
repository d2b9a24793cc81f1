"""How fast in-memory images (an .npz, ViT-S/16's 224 x 224 uint8) reach the train step.

  - host views (`data.augment.views=host`, the default on a CPU): DeiT's recipe made by PIL in 0, 1 and 2 worker
    processes, which read the array from shared memory (`splits.ArraySplit.share`), `ImageData.train_batch` timed
    directly;
  - device views (`views=device`, the default on a GPU): what the host still does per batch (a gather of the stored
    images), and `device_views.train_views` (RandomResizedCrop, flip, RandAugment(2, 9)) jitted on this CPU, for scale:
    on a GPU it is a small part of the step.

Images/s are over `--batches` batches of `--batch_size` after the first (which starts the workers), the
best of `--repeats` (the machine is shared). Results: experiments/images/memory_loader.json.

    python experiments/images/memory_loader.py [--n 2048] [--batch_size 64] [--batches 10] [--repeats 3]
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from transformer import config as config_lib  # noqa: E402
from transformer.data.images import batches, host_views  # noqa: E402
from transformer.data.images import sources as image_sources  # noqa: E402


def rate(data, batches: int, batch_size: int) -> float:
    data.train_batch(0)
    start = time.perf_counter()
    for step in range(1, batches + 1):
        data.train_batch(step)
    return batches * batch_size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "images.npz")
        rng = np.random.default_rng(0)
        np.savez(path, x=rng.integers(0, 256, (args.n, 224, 224, 3), dtype=np.uint8), y=rng.integers(0, 1000, args.n))
        config = config_lib.load(os.path.join(os.path.dirname(os.path.dirname(HERE)),
                                              f"configs/vit.py:s16,data.source={path}"))
        recipe = host_views.Recipe.of(config)
        results = {"cpus": os.cpu_count(), "batch_size": args.batch_size, "recipe": str(recipe), "host_views": {}}
        for workers in (0, 1, 2):
            best = 0.0
            for _ in range(args.repeats):
                data = batches.ImageData(image_sources.load(config.data, tmp), recipe, args.batch_size, 0,
                                         workers=workers)
                best = max(best, rate(data, args.batches, args.batch_size))
                if data.pool:
                    data.pool.shutdown()
            results["host_views"][workers] = best
            print(f"host views, {workers} workers: {best:,.0f} images/s", flush=True)
        data = batches.ImageData(image_sources.load(config.data, tmp), recipe, args.batch_size, 0, device_views=True)
        gather = max(rate(data, args.batches, args.batch_size) for _ in range(args.repeats))
        results["device_views_host_gather"] = gather
        print(f"device views: the host's gather {gather:,.0f} images/s", flush=True)
        import jax

        from transformer.data.images import device_views
        batch = data.train_batch(1)
        views = jax.jit(lambda x, e: device_views.train_views(x, e, recipe, 0))
        jax.block_until_ready(views(batch["images"], batch["example"]))
        start = time.perf_counter()
        for _ in range(args.repeats):
            jax.block_until_ready(views(batch["images"], batch["example"]))
        cpu = args.repeats * args.batch_size / (time.perf_counter() - start)
        results["device_views_on_this_cpu"] = cpu
        print(f"device views: train_views jitted on this CPU {cpu:,.0f} images/s", flush=True)
    with open(os.path.join(HERE, "memory_loader.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
