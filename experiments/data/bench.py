"""Tokenizing speed: MB/s of text per tokenizer and worker count, on the stdlib copied 8 times.

  python experiments/data/bench.py --gpt2_dir /tmp/gpt2/package [--copies 8] [--workers 1,2]

Each (tokenizer, workers) pair runs the real command line, `python -m transformer.data.tokenize`,
into a fresh store under /tmp, and reads the build's own timing (text MB and tokens over the
seconds from the first chunk sent to the last one written: a trained tokenizer's training is
timed apart, as the rest of the wall time). Results go to experiments/data/bench.json; the
table is printed in markdown. The machine's 1-minute load average before and after each run and
the workers' own CPU seconds are recorded beside it, and the CPU the machine's other processes
took during the run (from /proc/stat, less this command's own): on a shared machine, a run with
other processes near 0 cores is a quiet one, and MB per worker CPU-second says what a worker
does per core when the wall-clock MB/s is disturbed. `--quiet_load` waits for a quiet machine
before each run.
"""

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)
import corpus  # noqa: E402

KINDS = {"byte": [], "bpe": ["--vocab_size", "8192"], "wordpiece": ["--vocab_size", "8192"], "gpt2": []}


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all processes, all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(max_load: float, max_wait: float) -> float:
    """Waits until the 1-minute load average is below `max_load` (at most `max_wait` seconds); the wait."""
    start = time.perf_counter()
    while os.getloadavg()[0] >= max_load and time.perf_counter() - start < max_wait:
        time.sleep(10)
    return time.perf_counter() - start


def run(kind: str, workers: int, source: str, out: str, gpt2_dir: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    extra = KINDS[kind] + (["--tokenizer_path", gpt2_dir] if kind == "gpt2" else [])
    command = [sys.executable, "-m", "transformer.data.tokenize", "--source", source, "--out", out,
               "--tokenizer", kind, "--workers", str(workers), *extra]
    load_before = os.getloadavg()[0]
    start, busy, mine = time.perf_counter(), busy_cpu_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = (after.ru_utime + after.ru_stime) - (mine.ru_utime + mine.ru_stime)  # the command and its workers
    others = busy_cpu_seconds() - busy - mine  # what other processes took of the machine meanwhile
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr}")
    line = re.search(r"this run: (\d+) chunks, ([\d,.]+) MB in ([\d.]+) s = ([\d.]+) MB/s, ([\d,]+) tokens/s; "
                     r"workers' CPU ([\d.]+) s = ([\d.]+) MB per CPU-second", result.stdout)
    chunks, mb, seconds, mb_s, tok_s, cpu, mb_cpu = line.groups()
    with open(os.path.join(out, "index.json")) as f:
        index = json.load(f)
    shutil.rmtree(out)
    return {"tokenizer": kind, "workers": workers, "chunks": int(chunks), "text_mb": float(mb.replace(",", "")),
            "seconds": float(seconds), "mb_per_s": float(mb_s), "tokens_per_s": int(tok_s.replace(",", "")),
            "worker_cpu_seconds": float(cpu), "mb_per_cpu_second": float(mb_cpu),
            "wall_seconds": round(wall, 1), "load_1min_before_after": [load_before, load_after],
            "other_processes_cpu_seconds": round(others, 1), "other_processes_cores": round(others / wall, 2),
            "tokens": index["splits"]["train"]["tokens"] + index["splits"]["eval"]["tokens"],
            "fingerprint": index["fingerprint"]}


def baseline(gpt2_dir: str) -> dict:
    """The path before token stores, for comparison: the training run's serial tokenizing (the
    former lm.load_tokens: one `encode` per document, in one process) of the stdlib once with
    GPT-2's BPE."""
    from transformer.data.text import sources, tokenizers

    tokenizer = tokenizers.gpt2_tokenizer(gpt2_dir)
    texts = [t for _, t in sources.read_documents(sources.stdlib_files())]
    load_before = os.getloadavg()[0]
    start, cpu = time.perf_counter(), time.process_time()
    [tokenizer.encode(text).astype("uint16") for text in texts]
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    return {"tokenizer": "gpt2 (before stores: lm.load_tokens, serial)", "text_mb": round(mb, 1),
            "seconds": round(seconds, 1), "mb_per_s": round(mb / seconds, 2), "mb_per_cpu_second": round(mb / cpu, 2),
            "load_1min_before_after": [load_before, os.getloadavg()[0]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--gpt2_dir", default=os.environ.get("GPT2_TOKENIZER_DIR", ""))
    parser.add_argument("--results", default=os.path.join(HERE, "bench.json"))
    parser.add_argument("--quiet_load", type=float, default=0.0, help="before each run, wait until the 1-minute "
                        "load average is below this (0: never wait)")
    parser.add_argument("--max_wait", type=float, default=900, help="at most this many seconds per wait")
    args = parser.parse_args()
    source_dir = f"/tmp/stdlib_x{args.copies}"
    files, size = corpus.make(args.copies, source_dir)
    print(f"corpus {source_dir}: {files:,} files, {size / 1e6:,.1f} MB", flush=True)
    rows = []
    today = baseline(args.gpt2_dir) if args.gpt2_dir and "gpt2" in args.kinds.split(",") else None
    print(json.dumps(today), flush=True)
    for kind in args.kinds.split(","):
        for workers in map(int, args.workers.split(",")):
            waited = wait_for_quiet(args.quiet_load, args.max_wait) if args.quiet_load else 0.0
            row = run(kind, workers, f"{source_dir}/**/*.py", f"/tmp/bench_store_{kind}_{workers}", args.gpt2_dir)
            row["waited_for_quiet_seconds"] = round(waited, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.results, "w") as f:
        json.dump({"corpus": {"copies": args.copies, "files": files, "bytes": size}, "cpus": os.cpu_count(),
                   "today": today, "rows": rows}, f, indent=1)
    print("\n| tokenizer | workers | MB/s | tokens/s | speed-up | seconds | MB per worker CPU-s | other processes "
          "(cores) | load before | tokens | same shards |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        first = next(r for r in rows if r["tokenizer"] == row["tokenizer"])
        print(f"| {row['tokenizer']} | {row['workers']} | {row['mb_per_s']:.2f} | {row['tokens_per_s']:,} | "
              f"{row['mb_per_s'] / first['mb_per_s']:.2f}x | {row['seconds']:.1f} | {row['mb_per_cpu_second']:.2f} | "
              f"{row['other_processes_cores']:.2f} | {row['load_1min_before_after'][0]:.1f} | {row['tokens']:,} | "
              f"{'yes' if row['fingerprint'] == first['fingerprint'] else 'NO'} |")
    if today:
        print(f"\nToday's serial path (lm.load_tokens), GPT-2 on the stdlib once: {today['mb_per_s']:.2f} MB/s "
              f"({today['mb_per_cpu_second']:.2f} MB per CPU-second, load {today['load_1min_before_after'][0]:.1f})")


if __name__ == "__main__":
    main()
