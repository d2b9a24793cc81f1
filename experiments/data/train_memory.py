"""Training from a token store costs the same memory whatever the store's size: GPT tiny trains
50 steps from a stdlib store (~31 M tokens) and from one of the stdlib copied 70 times (more
than 2^31 tokens), and the peak memory of the run's whole process tree is compared; then
`transformer.bench --mode data` times the loader against the train step and the first batch at
step 0 and at step 10^7, on each store.

    python experiments/data/train_memory.py [--copies 70] [--keep]

The corpus and stores live under /tmp (deleted at the end unless --keep); the results go to
experiments/data/train_memory.json and the table printed here is committed in README.md there.
Needs psutil (installed with the test extras' ray).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import corpus  # noqa: E402  (experiments/data/corpus.py)

STEPS = 50


def peak_tree_rss(command: list[str], cwd: str) -> tuple[float, float, str]:
    """(peak MiB of the summed RSS of the process and its children, sampled every 50 ms; seconds; output)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root, peak = psutil.Process(process.pid), 0
    while process.poll() is None:
        try:
            tree = [p for p in [root, *root.children(recursive=True)] if p.is_running()]
            peak = max(peak, sum(p.memory_info().rss for p in tree))
        except psutil.Error:
            pass
        time.sleep(0.05)
    output = process.stdout.read()
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{output[-3000:]}")
    return peak / 2**20, time.perf_counter() - start, output


def tokenize(source: str, out: str) -> None:
    subprocess.run([sys.executable, "-m", "transformer.data.tokenize", "--source", source, "--out", out,
                    "--tokenizer", "byte", "--workers", "2"], cwd=REPO, check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=70)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    big_corpus = f"/tmp/stdlib_x{args.copies}"
    stores = {"stdlib": "/tmp/memory_store_stdlib", f"stdlib x {args.copies}": f"/tmp/memory_store_x{args.copies}"}
    files, size = corpus.make(args.copies, big_corpus)
    print(f"corpus {big_corpus}: {files:,} files, {size / 1e9:.2f} GB", flush=True)
    tokenize("stdlib", stores["stdlib"])
    tokenize(os.path.join(big_corpus, "**", "*.py"), stores[f"stdlib x {args.copies}"])
    results = {}
    for name, path in stores.items():
        index = json.load(open(os.path.join(path, "index.json")))
        workdir = f"/tmp/memory_run_{os.path.basename(path)}"
        shutil.rmtree(workdir, ignore_errors=True)
        train = [sys.executable, "-m", "transformer.train", "--config", "configs/gpt.py:tiny", "--workdir", workdir,
                 f"--config.data.source={path}", f"--config.train.steps={STEPS}", "--config.train.log_every=25",
                 f"--config.train.eval_every={STEPS}", f"--config.train.checkpoint_every={STEPS}",
                 "--config.train.sample_tokens=0"]
        peak, seconds, _ = peak_tree_rss(train, REPO)
        losses = [r for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl"))) if "train/loss" in r]
        bench = subprocess.run([sys.executable, "-m", "transformer.bench", "--config", "configs/gpt.py:tiny",
                                f"--config.data.source={path}", "--mode", "data", "--steps", "20"], cwd=REPO,
                               capture_output=True, text=True, check=True)
        results[name] = {"train_tokens": index["splits"]["train"]["tokens"], "peak_tree_rss_mib": round(peak, 1),
                         "seconds": round(seconds, 1), "final_train_loss": losses[-1]["train/loss"],
                         "bench_data": [line for line in bench.stdout.splitlines() if line.startswith("data:")]}
        print(json.dumps({name: results[name]}), flush=True)
        shutil.rmtree(workdir, ignore_errors=True)
    small, big = results["stdlib"], results[f"stdlib x {args.copies}"]
    results["difference_mib"] = round(big["peak_tree_rss_mib"] - small["peak_tree_rss_mib"], 1)
    results["within_300_mib"] = abs(results["difference_mib"]) <= 300
    results["machine"] = {"cpus": os.cpu_count(), "load_average": os.getloadavg()}
    with open(os.path.join(HERE, "train_memory.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"| store | train tokens | peak RSS of the process tree | time of {STEPS} steps |\n| --- | --- | --- | --- |")
    for name in stores:
        r = results[name]
        print(f"| {name} | {r['train_tokens']:,} | {r['peak_tree_rss_mib']:,.0f} MiB | {r['seconds']:.0f} s |")
    print(f"difference: {results['difference_mib']:+,.0f} MiB (within 300 MiB: {results['within_300_mib']})")
    if not args.keep:
        for path in [big_corpus, *stores.values()]:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
