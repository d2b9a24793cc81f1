"""Checks that a change of structure moved no number: each family's tiny preset, run for 100 steps
by an earlier commit (from a git worktree) and by the working tree, on the same machine, must
write the same metrics.jsonl (losses, norms and the eval at step 100) within 1e-6 relative.

    python experiments/house/same_numbers.py --base bb3cdc4 --workdir /tmp/same_numbers [--devices 1,8]

Runs are kept under WORKDIR/{base,head}/DEVICES/NAME; a rerun reuses finished ones (delete
WORKDIR/head to rerun the working tree after a change). Throughput (`*_per_s`) and `train/mfu`
(a rate over wall time) are not compared. Exit code 1 if any number moved.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 100
RTOL = 1e-6
RUNS = {
    "gpt": "configs/gpt.py:tiny",
    "bert-mlm": "configs/bert.py:tiny",
    "bert-package": "configs/bert.py:tiny,task=sequence_classification",
    "bert-tokentype": "configs/bert.py:tiny,task=token_classification",
    "vit": "configs/vit.py:tiny",
    "encdec": "configs/encdec.py:tiny",
}


def checkout(base: str, workdir: str) -> str:
    """A worktree of `base` under workdir (made once)."""
    path = os.path.join(workdir, "tree-" + base)
    if not os.path.isdir(path):
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", path, base], check=True,
                       capture_output=True)
    return path


def records(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def finished(run_dir: str) -> bool:
    return any(r["step"] == STEPS and "eval/loss" in r for r in records(run_dir))


def train(tree: str, spec: str, run_dir: str, devices: int) -> float:
    """Runs the tree's `transformer.train` for STEPS steps (the schedule unchanged); returns seconds."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    log = run_dir + ".log"
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    t = time.time()
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "transformer.train", "--config", spec, "--workdir", run_dir,
                               f"--config.train.stop_at={STEPS}"], cwd=tree, env=env, stdout=out, stderr=out)
    if done.returncode:
        raise SystemExit(f"{run_dir}: exit code {done.returncode}; see {log}")
    return time.time() - t


def compared(key: str) -> bool:
    """Throughput and the MFU (a rate over the step's wall time) differ run to run; every other number must not."""
    return key != "step" and not key.endswith("_per_s") and key != "train/mfu"


def differences(base: list[dict], head: list[dict]) -> list[str]:
    """Every number of `base` that `head` does not match within RTOL (same steps, same keys)."""
    by_step = {}
    for r in head:
        by_step.setdefault(r["step"], {}).update(r)
    moved = []
    for r in base:
        other = by_step.get(r["step"])
        if other is None:
            moved.append(f"step {r['step']}: missing")
            continue
        for key, value in r.items():
            if not compared(key):
                continue
            if key not in other:
                moved.append(f"step {r['step']} {key}: missing")
            elif not math.isclose(value, other[key], rel_tol=RTOL, abs_tol=1e-12):
                moved.append(f"step {r['step']} {key}: {value!r} -> {other[key]!r}")
    return moved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the commit to compare with")
    p.add_argument("--workdir", required=True)
    p.add_argument("--devices", default="1,8", help="fake CPU device counts")
    p.add_argument("--only", default="", help="comma-separated run names (default: all)")
    p.add_argument("--base_only", action="store_true", help="only run the base's runs (ahead of time)")
    args = p.parse_args()
    trees = {"base": checkout(args.base, args.workdir), "head": REPO}
    if args.base_only:
        del trees["head"]
    names = args.only.split(",") if args.only else list(RUNS)
    failed = False
    print("| run | devices | records | numbers compared | moved | base s | head s |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    for devices in map(int, args.devices.split(",")):
        for name in names:
            seconds = {}
            for side, tree in trees.items():
                run_dir = os.path.join(args.workdir, side, str(devices), name)
                seconds[side] = "cached" if finished(run_dir) else f"{train(tree, RUNS[name], run_dir, devices):.0f}"
            if args.base_only:
                continue
            base, head = (records(os.path.join(args.workdir, side, str(devices), name)) for side in trees)
            moved = differences(base, head)
            numbers = sum(1 for r in base for k in r if compared(k))
            print(f"| {name} | {devices} | {len(base)} | {numbers} | {len(moved)} | {seconds['base']} | "
                  f"{seconds['head']} |", flush=True)
            for line in moved[:5]:
                print(f"    {line}", flush=True)
            failed |= bool(moved)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
