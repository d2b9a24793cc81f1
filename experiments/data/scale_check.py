"""The large checks of token stores, on the stdlib copied 70 times (about 2.2 GB, more than 2^31 tokens).

  python experiments/data/scale_check.py [--copies 70] [--keep]

1. `--tokenizer byte --workers 2` builds a store (timed); it holds more than 2^31 tokens and its
   reader reads across a shard boundary past token 2^31.
2. `--workers 1` builds another: every shard's sha256 (computed here from the files) must match.
3. A third `--workers 2` build is killed with SIGKILL (its whole process group: the command and
   its workers) once half of its chunks are written; it must not open as a store; the same command
   run again finishes it (only the missing chunks) and its shards must match the first store's.

The corpus and stores live under /tmp and are deleted at the end (unless --keep). Results go to
experiments/data/scale_check.json and are printed.
"""

import argparse
import glob
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)
import corpus  # noqa: E402
import numpy as np  # noqa: E402

from transformer.data.text import token_store  # noqa: E402


def command(source: str, out: str, workers: int) -> list[str]:
    return [sys.executable, "-m", "transformer.data.tokenize", "--source", source, "--out", out,
            "--tokenizer", "byte", "--workers", str(workers)]


def run(args: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{result.stderr}")
    return time.perf_counter() - start, result.stdout


def shard_hashes(path: str) -> dict[str, str]:
    hashes = {}
    for file in sorted(glob.glob(os.path.join(path, "*", "*.bin"))):
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
        hashes[os.path.relpath(file, path)] = digest.hexdigest()
    return hashes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=70)
    parser.add_argument("--keep", action="store_true", help="keep the corpus and stores under /tmp")
    parser.add_argument("--results", default=os.path.join(HERE, "scale_check.json"))
    args = parser.parse_args()
    corpus_dir = f"/tmp/stdlib_x{args.copies}"
    start = time.perf_counter()
    files, size = corpus.make(args.copies, corpus_dir)
    results = {"corpus": {"copies": args.copies, "files": files, "bytes": size,
                          "seconds_to_copy": round(time.perf_counter() - start, 1)}, "cpus": os.cpu_count()}
    print(json.dumps(results), flush=True)
    source = f"{corpus_dir}/**/*.py"
    stores = {name: f"/tmp/scale_store_{name}" for name in ("w2", "w1", "killed")}
    for path in stores.values():
        shutil.rmtree(path, ignore_errors=True)

    seconds, out = run(command(source, stores["w2"], 2))
    st = token_store.Store.open(stores["w2"])
    train = st.split("train")
    total = len(train) + len(st.split("eval"))
    starts = train.offsets[1:-1]  # shard starts but the first: the first one past 2^31 (or the last one)
    boundary = int(starts[starts >= 2**31][0] if (starts >= 2**31).any() else starts[-1])
    crossing = train.read(boundary - 5, boundary + 5)
    shard = int(np.searchsorted(train.offsets, boundary))
    expected = np.concatenate([train.shards[shard - 1][-5:], train.shards[shard][:5]])
    results["workers_2"] = {"seconds": round(seconds, 1), "output": out.strip().splitlines(),
                            "tokens": total, "train_tokens": len(train), "more_than_2**31": total > 2**31,
                            "chunks": st.index["chunks"], "dtype": st.index["dtype"],
                            "boundary_read_at": boundary,
                            "read_across_boundary": bool(np.array_equal(crossing, expected)),
                            "fingerprint": st.fingerprint}
    print(json.dumps(results["workers_2"]), flush=True)
    reference = shard_hashes(stores["w2"])

    seconds, out = run(command(source, stores["w1"], 1))
    results["workers_1"] = {"seconds": round(seconds, 1), "output": out.strip().splitlines(),
                            "shards": len(reference), "identical_shards": shard_hashes(stores["w1"]) == reference}
    print(json.dumps(results["workers_1"]), flush=True)
    shutil.rmtree(stores["w1"])

    chunks = st.index["chunks"]
    process = subprocess.Popen(command(source, stores["killed"], 2), cwd=REPO, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start = time.perf_counter()
    while len(glob.glob(os.path.join(stores["killed"], token_store.CHUNKS_DIR, "*.json"))) < chunks // 2:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    killed_after = time.perf_counter() - start
    done = len(glob.glob(os.path.join(stores["killed"], token_store.CHUNKS_DIR, "*.json")))
    try:
        token_store.Store.open(stores["killed"])
        opens = True
    except FileNotFoundError:
        opens = False
    seconds, out = run(command(source, stores["killed"], 2))
    resumed_chunks = int(re.search(r"this run: (\d+) chunks", out).group(1))
    results["killed_and_resumed"] = {
        "killed_after_seconds": round(killed_after, 1), "chunks_done_when_killed": done, "chunks": chunks,
        "killed_store_opens": opens, "resume_seconds": round(seconds, 1), "resumed_chunks": resumed_chunks,
        "output": out.strip().splitlines(),
        "identical_shards": shard_hashes(stores["killed"]) == reference,
        "same_fingerprint": token_store.Store.open(stores["killed"]).fingerprint == st.fingerprint}
    print(json.dumps(results["killed_and_resumed"]), flush=True)
    # the largest resident memory of any one process (the command or a worker) of all the builds
    results["max_rss_mb_of_a_process"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
    print(json.dumps({"max_rss_mb_of_a_process": results["max_rss_mb_of_a_process"]}), flush=True)
    with open(args.results, "w") as f:
        json.dump(results, f, indent=1)
    if not args.keep:
        for path in [*stores.values(), corpus_dir]:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
