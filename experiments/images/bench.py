"""How fast the data workers make DeiT's train views at 224 x 224 from a folder of JPEGs, against what
the ViT-S/16 and ViT-B/16 train steps consume; and the process tree's peak memory against folder size.

  - folders of JPEGs (make_folder.py, quality 90), indexed as a run indexes them (`folders.open_index`):
    `digits` (3,000 digits upscaled to 256 x 256 RGB: flat colour, tiny files, cheap to decode),
    `digits_10x` (30,000 of them) and `photo_like` (3,000 at 384 x 384 with Gaussian noise of std 32:
    ~87 KB files, decode cost near an ImageNet JPEG's);
  - per image, in this process: decode alone (`splits.read_file`) and decode + DeiT's train view
    (`host_views.train_view`: RandomResizedCrop to 224, flip, RandAugment(2, 9));
  - per worker count (1, 2; the machine has 2 cores): `ImageData.train_batch` timed directly (not
    `transformer.bench --mode data`, which also compiles and runs the ViT-S train step) in a child
    process, configs/vit.py:s16 with data.batch_size=64: images/s over the batches after the first
    (which starts the workers), the best of 3 runs (the machine is shared; all are kept), and the peak
    RSS summed over the child's process tree (workers included; the highest of the runs);
  - the same with 2 workers on the folder 10x larger: the peak against folder size;
  - the train step's consumption: ViT-S/16 on this CPU measured by `python -m transformer.bench --mode
    train` at batch 8 (ViT-B/16 on this CPU: that rate x the FLOPs ratio, an estimate), and on one H100
    ESTIMATED from FLOPs (`transformer.inspect`: 3 x forward FLOPs per image) at 40% MFU of 989 TFLOP/s
    (dense bf16), not measured.

    python experiments/images/bench.py [--n 3000] [--big 30000] [--batches 20] [--repeats 3] [--keep]

Folders live under /tmp/images_bench/ (deleted at the end unless --keep); results go to
experiments/images/bench.json.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)
import make_folder  # noqa: E402  (experiments/images/make_folder.py)

TMP = "/tmp/images_bench"
ENV = {**os.environ, "PYTHONPATH": REPO}
H100_BF16_DENSE = 989e12
MFU = 0.40


def s16_config(source: str, batch_size: int = 64):
    import configs.vit as vit
    config = vit.get_config("s16")
    config.data.source = source
    config.data.batch_size = batch_size
    return config


def peak_tree_rss(command: list[str], timeout: float = 600) -> tuple[float, float, str, int]:
    """(peak MiB of the summed RSS of the process and its descendants, sampled every 50 ms; seconds;
    stdout; return code)."""
    start = time.perf_counter()
    log = f"{TMP}/child_{time.time_ns()}.err"
    process = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    root, peak = psutil.Process(process.pid), 0
    while process.poll() is None:
        try:
            peak = max(peak, sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]
                                 if p.is_running()))
        except psutil.Error:
            pass
        if time.perf_counter() - start > timeout:
            process.kill()
        time.sleep(0.05)
    output = process.stdout.read()
    if process.returncode:
        output += open(log).read()[-3000:]
    return peak / 2**20, time.perf_counter() - start, output, process.returncode


def child(folder: str, workers: int, batches: int) -> None:
    """Times ImageData.train_batch (prints one JSON line)."""
    import tempfile

    from transformer.data.images import batches as batches_lib
    from transformer.data.images import folders, host_views
    config = s16_config(folder)
    with tempfile.TemporaryDirectory() as workdir:
        t = time.perf_counter()
        _, splits = folders.open_index(config.data, workdir, show=False)
        index_s = time.perf_counter() - t
        recipe = host_views.Recipe.of(config)
        t = time.perf_counter()
        data = batches_lib.ImageData(splits, recipe, config.data.batch_size, config.train.seed, workers=workers)
        batch = data.train_batch(0)
        first_s = time.perf_counter() - t
        t = time.perf_counter()
        for step in range(1, batches + 1):
            batch = data.train_batch(step)
        seconds = time.perf_counter() - t
        assert batch["images"].shape == (64, 224, 224, 3) and batch["images"].dtype == np.uint8
        print(json.dumps({"workers": workers, "images": len(splits["train"]), "index_s": round(index_s, 2),
                          "first_batch_s": round(first_s, 2), "batches_timed": batches,
                          "images_per_s": round(config.data.batch_size * batches / seconds, 1)}))


def per_image(folder: str, n: int = 200) -> dict:
    """Seconds per image in this process (one thread): decode alone, decode + train view."""
    import tempfile

    from transformer.data.images import folders, host_views
    config = s16_config(folder)
    recipe = host_views.Recipe.of(config)
    with tempfile.TemporaryDirectory() as workdir:
        _, splits = folders.open_index(config.data, workdir, show=False)
        train = splits["train"]
        t = time.perf_counter()
        for i in range(n):
            train.read(i)
        decode = (time.perf_counter() - t) / n
        t = time.perf_counter()
        for i in range(n):
            host_views.train_view(train.read(i), recipe, np.random.default_rng([0, i]))
        view = (time.perf_counter() - t) / n
    return {"images": n, "decode_ms": round(1e3 * decode, 2), "decode_and_train_view_ms": round(1e3 * view, 2),
            "one_thread_images_per_s": round(1 / view, 1)}


def train_step_cpu(folder: str, timeout: float) -> dict:
    """ViT-S/16's train step on this CPU at batch 8 (transformer.bench --mode train)."""
    command = [sys.executable, "-m", "transformer.bench", "--config", "configs/vit.py:s16", "--mode", "train",
               f"--config.data.source={folder}", "--config.data.batch_size=8", "--config.data.workers=2",
               "--steps", "3", "--warmup", "1"]
    peak, seconds, output, rc = peak_tree_rss(command, timeout)
    match = re.search(r"ours: ([\d.,]+)\s*([kM]?) images/s \| step ([\d.,]+) ms", output)
    if rc or not match:
        return {"command": " ".join(command[1:]), "rc": rc, "seconds": round(seconds), "output": output[-1500:]}
    scale = {"": 1, "k": 1e3, "M": 1e6}[match.group(2)]
    return {"command": "python " + " ".join(command[1:]), "batch": 8,
            "images_per_s": float(match.group(1).replace(",", "")) * scale,
            "step_ms": float(match.group(3).replace(",", "")), "seconds": round(seconds),
            "lines": [line for line in output.splitlines() if line.startswith(("ours", "model"))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--big", type=int, default=30000)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train_timeout", type=float, default=420)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("FOLDER", "WORKERS", "BATCHES"))
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]), int(args.child[2]))
    os.makedirs(TMP, exist_ok=True)
    started = time.time()
    from transformer.models.flops import forward_flops
    results = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
               "machine": {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
                           "note": "2 cores shared with another developer's test runs: rates are noisy"},
               "recipe": "configs/vit.py:s16 (DeiT): RandomResizedCrop 224, flip, RandAugment(2, 9); mixup/cutmix "
                         "run on the device, not in the workers",
               "folders": {}}
    kinds = {"digits": (args.n, 256, 0.0), "digits_10x": (args.big, 256, 0.0), "photo_like": (args.n, 384, 32.0)}
    folders = {}
    for kind, (n, size, noise) in kinds.items():
        folder = f"{TMP}/{kind}_{n}"
        t = time.perf_counter()
        made = make_folder.make(folder, n, size, "jpeg", 0, noise=noise)
        folders[kind] = folder
        results["folders"][kind] = {"images": n,
                                    "size": f"{size} x {size} JPEG q90" + (f", noise std {noise:g}" if noise else ""),
                                    "disk_mb": round(made["bytes"] / 1e6, 1),
                                    "kb_per_file": round(made["bytes"] / n / 1e3, 1),
                                    "decoded_mb": round(made["decoded_bytes"] / 1e6, 1),
                                    "write_s": round(time.perf_counter() - t, 1)}
        print(json.dumps({folder: results["folders"][kind]}), flush=True)
    results["per_image_one_thread"] = {kind: per_image(folders[kind]) for kind in ("digits", "photo_like")}
    print(json.dumps({"per image": results["per_image_one_thread"]}), flush=True)
    loader = {}
    for kind, workers in (("digits", 1), ("digits", 2), ("digits_10x", 2), ("photo_like", 1), ("photo_like", 2)):
        command = [sys.executable, os.path.abspath(__file__), "--child", folders[kind], str(workers), str(args.batches)]
        runs = []
        for _ in range(args.repeats):  # the machine is shared: the best of a few runs, and all of them
            load = os.getloadavg()[0]
            peak, seconds, output, rc = peak_tree_rss(command)
            if rc:
                raise SystemExit(f"child failed:\n{output}")
            runs.append({**json.loads(output.strip().splitlines()[-1]), "peak_tree_rss_mib": round(peak, 1),
                         "seconds": round(seconds, 1), "load_average_1min_before": round(load, 2)})
        best = max(runs, key=lambda r: r["images_per_s"])
        row = {"folder": kind, **best, "folder_images": kinds[kind][0],
               "images_per_s_runs": [r["images_per_s"] for r in runs],
               "peak_tree_rss_mib_runs": [r["peak_tree_rss_mib"] for r in runs],
               "peak_tree_rss_mib": max(r["peak_tree_rss_mib"] for r in runs)}
        loader[f"{kind}_{workers}"] = row
        print(json.dumps({"loader": row}), flush=True)
    results["loader"] = loader
    results["peak_rss_difference_mib_10x_folder_minus_folder_2_workers"] = round(
        loader["digits_10x_2"]["peak_tree_rss_mib"] - loader["digits_2"]["peak_tree_rss_mib"], 1)
    flops = {name: forward_flops(s16_config(folders["digits"]) if name == "s16" else
                                 __import__("configs.vit", fromlist=["x"]).get_config(name))["per_example"]
             for name in ("s16", "b16")}
    cpu = train_step_cpu(folders["photo_like"], args.train_timeout)
    print(json.dumps({"train step cpu": cpu}), flush=True)
    consumption = {}
    for name in ("s16", "b16"):
        train_flops = 3 * flops[name]
        row = {"training_flops_per_image": train_flops,
               "h100_bf16_images_per_s_ESTIMATE": round(MFU * H100_BF16_DENSE / train_flops),
               "h100_estimate_basis": f"{MFU:.0%} MFU of {H100_BF16_DENSE / 1e12:.0f} TFLOP/s dense bf16; not measured"}
        if "images_per_s" in cpu:
            rate = cpu["images_per_s"] * (flops["s16"] / flops[name])
            row["cpu_images_per_s"] = round(rate, 2)
            row["cpu_basis"] = ("measured (batch 8)" if name == "s16"
                                else "ESTIMATE: the measured ViT-S/16 rate x FLOPs ratio")
        for kind in ("digits", "photo_like"):
            two, one = loader[f"{kind}_2"]["images_per_s"], loader[f"{kind}_1"]["images_per_s"]
            row[f"{kind}: loader_2_workers_over_h100_estimate"] = round(two / row["h100_bf16_images_per_s_ESTIMATE"], 4)
            row[f"{kind}: workers_to_feed_one_h100_ESTIMATE"] = round(row["h100_bf16_images_per_s_ESTIMATE"] / one, 1)
            if "cpu_images_per_s" in row:
                row[f"{kind}: loader_2_workers_over_cpu_step"] = round(two / row["cpu_images_per_s"], 1)
        consumption[name] = row
    results["train_step"] = {"cpu_measured": cpu, "consumption": consumption}
    print(json.dumps({"consumption": consumption}), flush=True)
    results["load_average_at_end"] = os.getloadavg()
    results["seconds"] = round(time.time() - started)
    with open(os.path.join(HERE, "bench.json"), "w") as f:
        json.dump(results, f, indent=1)
    if not args.keep:
        shutil.rmtree(TMP, ignore_errors=True)


if __name__ == "__main__":
    main()
