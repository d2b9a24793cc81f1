"""Image folders at scale (issue 18), four checks of `transformer.train` on folders written by
make_folder.py (scikit-learn's digits upscaled to 64 x 64 RGB, shifted):

  1. memory: ViT tiny (64 x 64, patch 8, batch 64, data.workers=2) trains 100 steps, one eval at the
     end, on a folder of 50,000 PNGs (~600 MB decoded) and on one of 1,000: the peak RSS summed over
     the run's process tree (the workers included, sampled every 50 ms) differs by at most 300 MiB.
  2. identical losses: the 1,000 PNGs as a folder and as an .npz (same order), no augmentation, the
     same seed: the same split (checked image by image) and train/loss equal at every step; with
     sampled statistics and with fixed ones.
  3. exact resume with every augmentation on: 30 steps uninterrupted against the same run stopped by
     SIGTERM after ~step 12 and relaunched, and against one killed by SIGKILL (checkpoint_every=5) and
     relaunched; after the kill no process of the run's tree is left.
  4. a truncated JPEG in a small folder: the run finishes, stderr names the file once, and the
     replaced_images metrics count it as often as the batches held it.

    python experiments/images/scale_check.py [--big 50000] [--keep]

Folders and runs live under /tmp/images_scale/ (deleted at the end unless --keep); the results go
to experiments/images/scale_check.json. Needs psutil.
"""

import argparse
import io
import json
import os
import shutil
import signal
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

TMP = "/tmp/images_scale"
ENV = {**os.environ, "PYTHONPATH": REPO}
BASE = "configs/vit.py:tiny,model.image_size=64,model.patch_size=8,model.channels=3"


def train_command(source: str, workdir: str, steps: int, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "transformer.train", "--config", f"{BASE},data.source={source}",
            "--workdir", workdir, f"--config.train.steps={steps}", "--config.data.batch_size=64",
            *[f"--config.{o}" for o in overrides]]


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def launch(command: list[str], log: str) -> subprocess.Popen:
    """The command with stdout and stderr to LOG.out / LOG.err (files: no pipe to fill)."""
    return subprocess.Popen(command, cwd=REPO, env=ENV, stdout=open(log + ".out", "w"), stderr=open(log + ".err", "w"))


def run(command: list[str], log: str, watch=None) -> dict:
    """Runs the command: {'peak_tree_rss_mib', 'seconds', 'rc'}; `watch(process)` is called every 50 ms
    and may signal it."""
    start = time.perf_counter()
    process = launch(command, log)
    peak = 0
    while process.poll() is None:
        try:
            peak = max(peak, sum(p.memory_info().rss for p in tree(process.pid) if p.is_running()))
        except psutil.Error:
            pass
        if watch:
            watch(process)
        time.sleep(0.05)
    result = {"peak_tree_rss_mib": round(peak / 2**20, 1), "seconds": round(time.perf_counter() - start, 1),
              "rc": process.returncode}
    if process.returncode and not watch:
        raise SystemExit(f"{' '.join(command)} failed:\n{open(log + '.err').read()[-3000:]}")
    return result


def rows(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def losses(workdir: str) -> dict[int, list[float]]:
    """{step: [train/loss of each row logged at that step]} (a relaunched run may log a step twice)."""
    out = {}
    for r in rows(workdir):
        if "train/loss" in r:
            out.setdefault(r["step"], []).append(r["train/loss"])
    return out


def compare(a: dict, b: dict) -> dict:
    """Max |difference| of the last loss per step over the steps of both; steps missing from either."""
    steps = sorted(set(a) & set(b))
    diffs = [abs(a[s][-1] - b[s][-1]) for s in steps]
    return {"steps_compared": len(steps), "missing": sorted(set(a) ^ set(b)),
            "max_abs_difference": max(diffs) if diffs else None,
            "equal": bool(diffs) and set(a) == set(b) and max(diffs) <= 1e-6}


def fresh(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    return path


# ---------------------------------------------------------------- 1. memory


def check_memory(big: str, small: str, counts: dict) -> dict:
    out = {}
    for name, folder in (("big", big), ("small", small)):
        workdir = fresh(f"{TMP}/run_memory_{name}")
        command = train_command(folder, workdir, 100, "data.workers=2", "data.test_fraction=0.02",
                                "train.log_every=10", "train.eval_every=100", "train.checkpoint_every=100")
        r = run(command, f"{TMP}/memory_{name}")
        evals = [x for x in rows(workdir) if "eval/loss" in x]
        out[name] = {"folder": folder, **counts[name], **r, "final_train_loss": losses(workdir)[100][-1],
                     "evals": len(evals), "eval_accuracy": evals[-1]["eval/accuracy"] if evals else None}
        print(json.dumps({f"memory {name}": out[name]}), flush=True)
    out["difference_mib"] = round(out["big"]["peak_tree_rss_mib"] - out["small"]["peak_tree_rss_mib"], 1)
    out["within_300_mib"] = abs(out["difference_mib"]) <= 300
    return out


# ---------------------------------------------------------------- 2. folder == npz


def same_split(folder_workdir: str, npz: str, test_fraction: float) -> dict:
    """The folder run's index (its train and test files, decoded) against the .npz split by image_sources.load_npz."""
    from transformer.data.images import host_views
    from transformer.data.images import sources as image_sources
    from transformer.data.images import splits as splits_lib
    arrays = image_sources.load_npz(npz, test_fraction)
    out = {}
    for split in ("train", "test"):
        paths = np.load(os.path.join(folder_workdir, "images", f"{split}_paths.npy"))
        labels = np.load(os.path.join(folder_workdir, "images", f"{split}_labels.npy"))
        root = json.load(open(os.path.join(folder_workdir, "images", "index.json")))["source"]
        x = np.stack([host_views.as_array(host_views.as_pil(splits_lib.read_file(os.path.join(root, p.decode())), 3))
                      for p in paths])
        out[split] = {"images": len(paths), "pixels_equal": bool(np.array_equal(x, arrays[split][0])),
                      "labels_equal": bool(np.array_equal(labels, arrays[split][1]))}
    out["same"] = all(out[s]["pixels_equal"] and out[s]["labels_equal"] for s in ("train", "test"))
    return out


def check_identical(small: str, npz: str) -> dict:
    out = {}
    common = ["train.log_every=1", "train.eval_every=1000", "train.checkpoint_every=1000", "optim.warmup_steps=5",
              "data.test_fraction=0.2"]
    for stats, extra in (("sampled statistics", []),
                         ("fixed statistics", ["data.mean=(77.7,177.3,38.7)", "data.std=(95.8,95.8,47.7)"])):
        got = {}
        for name, source in (("folder", small), ("npz", npz)):
            workdir = fresh(f"{TMP}/run_identical_{name}_{len(extra)}")
            run(train_command(source, workdir, 20, *common, *extra), f"{TMP}/identical_{name}_{len(extra)}")
            got[name] = {"losses": losses(workdir), "workdir": workdir,
                         "config_mean_std": [json.load(open(os.path.join(workdir, "config.json")))["data"][k]
                                             for k in ("mean", "std")],
                         "statistics": json.load(open(os.path.join(workdir, "images", "statistics.json")))
                         if not extra else None}
        r = compare(got["folder"]["losses"], got["npz"]["losses"])
        r["config_mean_std"] = got["folder"]["config_mean_std"]
        r["losses_folder"] = [got["folder"]["losses"][s][-1] for s in sorted(got["folder"]["losses"])]
        r["losses_npz"] = [got["npz"]["losses"][s][-1] for s in sorted(got["npz"]["losses"])]
        if not extra:
            r["statistics_folder"] = got["folder"]["statistics"]
            r["statistics_npz"] = got["npz"]["statistics"]
            out["split"] = same_split(got["folder"]["workdir"], npz, 0.2)
        out[stats] = r
        print(json.dumps({f"identical ({stats})": {k: r[k] for k in ("steps_compared", "max_abs_difference",
                                                                       "equal")}}), flush=True)
    return out


# ---------------------------------------------------------------- 3. exact resume


AUGMENT = ["data.augment.random_resized_crop=True", "data.augment.flip=True", "data.augment.rand_augment_ops=2",
           "data.augment.mixup_alpha=0.8", "data.augment.cutmix_alpha=1.0", "model.drop_path=0.1",
           "train.label_smoothing=0.1", "data.workers=2", "train.log_every=1", "train.eval_every=30",
           "optim.warmup_steps=5", "data.test_fraction=0.2"]


def stop_after(workdir: str, step: int, sig: int, seen: dict):
    """A watch that sends `sig` to the process once metrics.jsonl has logged `step`, noting its tree first."""
    def watch(process):
        if "sent" not in seen and any(r.get("step", 0) >= step for r in rows(workdir)):
            seen["tree"] = [p.pid for p in tree(process.pid)[1:]]
            seen["logged_at_signal"] = max(r["step"] for r in rows(workdir))
            os.kill(process.pid, sig)
            seen["sent"] = time.time()
    return watch


def check_resume(small: str) -> dict:
    out = {}
    straight = fresh(f"{TMP}/run_resume_straight")
    run(train_command(small, straight, 30, *AUGMENT, "train.checkpoint_every=1000"), f"{TMP}/resume_straight")
    reference = losses(straight)
    out["uninterrupted_losses"] = [reference[s][-1] for s in sorted(reference)]
    for name, sig, every in (("SIGTERM", signal.SIGTERM, 1000), ("SIGKILL", signal.SIGKILL, 5)):
        workdir = fresh(f"{TMP}/run_resume_{name}")
        command = train_command(small, workdir, 30, *AUGMENT, f"train.checkpoint_every={every}")
        seen = {}
        first = run(command, f"{TMP}/resume_{name}_1", stop_after(workdir, 12, sig, seen))
        stopped_at = max(losses(workdir))
        left = []
        if sig == signal.SIGKILL:
            time.sleep(3)  # the workers notice their parent's death
            for pid in seen.get("tree", []):
                try:
                    p = psutil.Process(pid)
                    if p.status() != psutil.STATUS_ZOMBIE:
                        left.append({"pid": pid, "name": p.name(), "status": p.status(),
                                     "cmdline": " ".join(p.cmdline())[:200]})
                        p.kill()  # ours: started by this script's run
                except psutil.NoSuchProcess:
                    pass
        checkpoints = sorted(os.listdir(os.path.join(workdir, "checkpoints"))) \
            if os.path.isdir(os.path.join(workdir, "checkpoints")) else []
        second = run(command, f"{TMP}/resume_{name}_2")
        got = losses(workdir)
        relogged = {s: v for s, v in got.items() if len(v) > 1}
        r = compare(reference, got)
        r.update(first_rc=first["rc"], logged_at_signal=seen.get("logged_at_signal"), last_logged_before_relaunch=
                 stopped_at, checkpoints_before_relaunch=checkpoints, relaunch_rc=second["rc"],
                 steps_logged_twice=sorted(relogged),
                 twice_logged_equal=all(abs(v[0] - v[-1]) <= 1e-6 for v in relogged.values()),
                 resumed_losses=[got[s][-1] for s in sorted(got)])
        if sig == signal.SIGKILL:
            r["processes_in_tree_at_kill"] = len(seen.get("tree", []))
            r["left_running_after_kill"] = left
        out[name] = r
        print(json.dumps({f"resume {name}": {k: v for k, v in r.items() if "losses" not in k}}), flush=True)
    return out


# ---------------------------------------------------------------- 4. truncated JPEG


def check_truncated(folder: str) -> dict:
    import ml_collections
    from PIL import Image

    from transformer.data.images import batches, host_views
    from transformer.data.images import sources as image_sources
    buffer = io.BytesIO()
    Image.fromarray(make_folder.image(0, 64, 0)[0]).save(buffer, format="JPEG", quality=90)
    bad = os.path.join(folder, "3", "000000_truncated.jpg")
    with open(bad, "wb") as f:
        f.write(buffer.getvalue()[:300])
    workdir = fresh(f"{TMP}/run_truncated")
    steps = 30
    r = run(train_command(folder, workdir, steps, "data.workers=2", "train.log_every=1", f"train.eval_every={steps}",
                          "data.test_fraction=0.2"), f"{TMP}/truncated")
    stderr = open(f"{TMP}/truncated.err").read()
    named = [line for line in stderr.splitlines() if bad in line]
    metrics = rows(workdir)
    train_count = sum(x.get("train/replaced_images_since_last_log", 0) for x in metrics)
    eval_count = sum(x.get("eval/replaced_images", 0) for x in metrics)
    # how often the batches held it: the train stream's indices (seed from the run's config), the test split
    config = json.load(open(os.path.join(workdir, "config.json")))
    splits = image_sources.load(ml_collections.ConfigDict(config["data"]), workdir)
    rel = os.path.relpath(bad, os.path.abspath(folder)).encode()
    where = {s: [i for i, p in enumerate(np.asarray(splits[s].paths)) if p == rel] for s in ("train", "test")}
    data = batches.ImageData(splits, host_views.Recipe(64, 3), 64, config["train"]["seed"])
    held = sum(int(np.isin(data.train_indices(step), where["train"]).sum()) for step in range(steps))
    out = {"file": bad, "bytes_written": 300, **r,
           "finished": r["rc"] == 0 and any(x.get("step") == steps for x in metrics),
           "stderr_lines_naming_it": len(named), "stderr_line": named[0] if named else None,
           "in_split": {s: len(v) for s, v in where.items()}, "train_replaced_images_sum": train_count,
           "eval_replaced_images_sum": eval_count, "expected_train_count": held,
           "expected_eval_count": len(where["test"])}
    out["ok"] = (out["finished"] and len(named) == 1 and train_count == held and eval_count == len(where["test"])
                 and train_count + eval_count > 0)
    print(json.dumps({"truncated": out}), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", type=int, default=50_000)
    parser.add_argument("--small", type=int, default=1_000)
    parser.add_argument("--only", default="memory,identical,resume,truncated")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    only = args.only.split(",")
    os.makedirs(TMP, exist_ok=True)
    started = time.time()
    big, small, npz, bad = f"{TMP}/png{args.big}", f"{TMP}/png{args.small}", f"{TMP}/png{args.small}.npz", f"{TMP}/bad"
    counts = {}
    for name, folder, n, extra in (("small", small, args.small, {"npz": npz}), ("big", big, args.big, {})):
        if name == "big" and "memory" not in only:
            continue
        t = time.perf_counter()
        made = make_folder.make(fresh(folder), n, 64, "png", 0, **extra)
        counts[name] = {"images": n, "disk_mb": round(made["bytes"] / 1e6, 1),
                        "decoded_mb": round(made["decoded_bytes"] / 1e6, 1)}
        print(f"{folder}: {n:,} PNGs, {made['bytes'] / 1e6:.1f} MB on disk, {made['decoded_bytes'] / 1e6:.0f} MB "
              f"decoded, written in {time.perf_counter() - t:.0f} s", flush=True)
    results = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
               "machine": {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
                           "note": "2 cores shared with another developer's test runs"}}
    path = os.path.join(HERE, "scale_check.json")
    previous = json.load(open(path)) if os.path.exists(path) else {}
    if "memory" in only:
        results["memory"] = check_memory(big, small, counts)
    if "identical" in only:
        results["identical"] = check_identical(small, npz)
    if "resume" in only:
        results["resume"] = check_resume(small)
    if "truncated" in only:
        make_folder.make(fresh(bad), 200, 64, "png", 1)
        results["truncated"] = check_truncated(bad)
    results["load_average_at_end"] = os.getloadavg()
    results["seconds"] = round(time.time() - started)
    with open(path, "w") as f:
        json.dump({**previous, **results}, f, indent=1)
    if not args.keep:
        shutil.rmtree(TMP, ignore_errors=True)


if __name__ == "__main__":
    main()
