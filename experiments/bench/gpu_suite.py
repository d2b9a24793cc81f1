"""The GPU suite: every GPU measurement the project tracks, in one command, each against its target and
beside the last committed results (GPU.md, next to this script).

  python experiments/bench/gpu_suite.py                          # all rows, ~9 minutes on one H100
  python experiments/bench/gpu_suite.py --rows gpt2-small,attention
  python experiments/bench/gpu_suite.py --record                 # and write the table into GPU.md
  python experiments/bench/gpu_suite.py --budget_s 500 --record $OUT/GPU.md   # inside a 10-minute device call

On a lent device machine, `bash experiments/bench/gpu_session.sh` is the whole call (see there).

Run from anywhere: each row runs in a process of its own from the repository's root (`python -m
transformer.bench ... --json`, `python -m transformer.bench.attention`, or the quickstart's command)
under a time limit, so it starts with the GPU's memory free, and a row that fails, runs out of memory
or of time is a cell of the table, not the end of the suite. Every row compiles afresh (JAX's
compilation cache off), as on a machine that never ran it. The rows are the table of issues 34 and 35
(what the first GPU measurement found slow), each with its target; the table printed at the end has,
per row, what was measured, what GPU.md holds for it, the target and whether it is met. On a machine
without an NVIDIA GPU the suite says so in one line (exit code 2).

A device call has a hard limit, so `--budget_s` bounds the whole suite: each row runs under the smaller
of its own limit and what is left, a row is not started with under MIN_ROW_S left (its cell says so),
and `--record` rewrites the table (and every row's raw result, GPU.json beside it) after each row, so
a suite cut short still leaves what it measured.
"""

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RECORD = os.path.join(HERE, "GPU.md")
GPT = "configs/gpt.py:gpt2-small,data.seq_len=1024,model.dtype=bfloat16,model.vocab_size=50257"  # GPT-2's, not bytes
VIT = "configs/vit.py:s16,data.source={images},data.batch_size=256,model.dtype=bfloat16"
QUICK = ("--steps", "8", "--warmup", "2", "--rounds", "2")
MIN_ROW_S = 45


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: `args` of `kind` ('bench', 'attention', 'quickstart', 'script': a script's path
    and its flags, run from the repository's root, writing `--json`); `read(result,
    results)` -> (what to print, whether the target is met or None), `results` the rows measured before."""

    key: str
    what: str
    kind: str
    args: tuple
    read: Callable
    target: str = ""
    limit_s: int = 240


def _train(result: dict) -> tuple[str, float]:
    t = result["train"]
    rate = f"{t['items_per_s'] / 1e3:,.1f}k" if t["items_per_s"] >= 1e4 else f"{t['items_per_s']:,.0f}"
    mfu = f", MFU {t['mfu']:.1%}" if t.get("mfu") else ""
    peer = f", {t['ratio']:.2f}x the {t['peer']} peer" if "ratio" in t else ""
    return f"{rate}/s, {1e3 * t['step_s']:.1f} ms{mfu}{peer}, compile {t['compile_s']:.0f} s", t["items_per_s"]


def _at_least(value: Callable, least: float) -> Callable:
    """read() of a train row whose target is value(result, results) >= least."""
    def read(result, results):
        text, _ = _train(result)
        got = value(result, results)
        return text, None if got is None else got >= least
    return read


def _runs(result, results):
    return _train(result)[0], True


def _data(result, results):
    d = result["data"]
    return f"loader {d['loader_per_s']:,.0f}/s alone, the step consumes {d['step_per_s']:,.0f}/s", \
        d["loader_per_s"] >= d["step_per_s"]


def _generate(result, results):
    g = result["generate"]
    return ", ".join(f"batch {b}: {g[f'ours_b{b}']['decode_ms']:.2f} ms/token, "
                     f"prefill {g[f'ours_b{b}']['prefill_ms']:.1f} ms" for b in (1, 8) if f"ours_b{b}" in g), None


def _decode(result, results):
    """The engine's decode rows (experiments/engine/bench.py --json): tokens/s and MBU a batch."""
    cells = [f"batch {b}: {r['decode_tok_s']:,.0f} tok/s, MBU {100 * r['mbu']:.0f}%" for b, r in result.items()]
    return "; ".join(cells), result["1"]["mbu"] >= 0.6 if "1" in result else None


def _quickstart(result, results):
    return f"{result['seconds']:.1f} s (the command, compile and evals included)", result["seconds"] < 20


def _attention(rows, results):
    """auto's time against cuDNN's (the `cudnn` reference) in each column, and the path auto took."""
    cells, worst = [], 0.0
    for length, mask in ((2048, "causal"), (16384, "causal"), (16384, "window512"), (16384, "none"),
                         (16384, "documents")):
        got = {r["implementation"]: r for r in rows if r["length"] == length and r["mask"] == mask}
        auto, ref = got.get("auto", {}), got.get("cudnn", {})
        if "ms" not in auto:
            cells.append(f"{length} {mask}: {auto.get('error', 'missing')}")
            continue
        ratio = f" ({auto['ms'] / ref['ms']:.2f}x cuDNN)" if "ms" in ref else ""
        if "ms" in ref:
            worst = max(worst, auto["ms"] / ref["ms"])
        cells.append(f"{length} {mask}: {auto['ms']:.2f} ms{ratio}")
    return "; ".join(cells), (worst <= 1.15) if worst else None


def _mfu(result, results):
    return result["train"].get("mfu") or 0.0


def _vs_peer(result, results):
    return result["train"].get("ratio")


def _vs_plain(result, results):
    plain = results.get("gpt2-small")
    return plain and result["train"]["items_per_s"] / plain["train"]["items_per_s"]


NOAUG = ",data.augment.random_resized_crop=false,data.augment.flip=false,data.augment.rand_augment_ops=0," \
        "data.augment.mixup_alpha=0.0,data.augment.cutmix_alpha=0.0"
ROWS = (
    Row("attention", "attention fwd+bwd, bf16, B1 H16 K4 Dh64: auto against cuDNN", "attention",
        ("--lengths", "2048,16384", "--implementations", "auto,cudnn", "--repeats", "5"), _attention,
        "auto within 1.15x of cuDNN", 240),
    Row("gpt2-small", "gpt2-small 16 x 1024, default config, vs the nanoGPT-style torch.compile peer", "bench",
        ("--config", f"{GPT},data.batch_size=16", "--vs", "torch", "--rounds", "3", "--steps", "10"),
        _at_least(_vs_peer, 1.2), ">= 1.2x the peer", 300),
    Row("gpt2-small-docs", "gpt2-small 16 x 1024, data.document_mask=true", "bench",
        ("--config", f"{GPT},data.batch_size=16,data.document_mask=true", *QUICK), _at_least(_vs_plain, 0.9),
        ">= 0.9x gpt2-small's tokens/s"),
    Row("gpt2-small-b32", "gpt2-small 32 x 1024, default config", "bench",
        ("--config", f"{GPT},data.batch_size=32", *QUICK), _runs, "runs"),
    Row("gpt2-xl", "gpt2-xl 8 x 1024, scanned layers, model.remat=auto", "bench",
        ("--config", "configs/gpt.py:gpt2-xl,data.seq_len=1024,data.batch_size=8,model.dtype=bfloat16,"
                     "model.vocab_size=50257,model.scan_layers=true,model.remat=auto", "--steps", "4", "--warmup", "1"),
        _at_least(_mfu, 0.45), "MFU >= 45%", 420),
    Row("tiny-long", "GPT tiny at 65,536 tokens, default config", "bench",
        ("--config", "configs/gpt.py:tiny-long,model.dtype=bfloat16", "--steps", "4", "--warmup", "1"),
        _at_least(_mfu, 0.45), "MFU >= 45%"),
    Row("vit-s16", "ViT-S/16, batch 256, DeiT recipe, pre-decoded images in memory", "bench",
        ("--config", VIT, *QUICK), _at_least(_mfu, 0.35), "MFU >= 35%"),
    Row("vit-s16-flash", "ViT-S/16, batch 256, no augmentation, model.attention=flash", "bench",
        ("--config", f"{VIT},model.attention=flash{NOAUG}", *QUICK), _runs, "runs"),
    Row("vit-s16-data", "ViT-S/16 DeiT recipe: the loader alone against the step", "bench",
        ("--config", VIT, "--mode", "data", "--steps", "8"), _data, "loader >= the step"),
    Row("bert-base", "BERT-base MLM 32 x 512", "bench",
        ("--config", "configs/bert.py:bert-base,data.seq_len=512,data.batch_size=32,model.dtype=bfloat16", *QUICK),
        _at_least(_mfu, 0.35), "MFU >= 35%"),
    Row("generate", "gpt2-small generation, prompt 512 + 64, greedy, kv cache", "bench",
        ("--config", GPT, "--mode", "generate", "--prompt_len", "512", "--new_tokens", "64", "--gen_rounds", "2"),
        _generate),
    Row("decode", "gpt2-small-shaped decode, the engine (paged attention), bf16, 16-token prompts + 64", "script",
        ("experiments/engine/bench.py", "--layers", "12", "--batches", "1,64", "--new", "64", "--peer", "0",
         "--serve", "0", "--dtype", "bfloat16"), _decode, "MBU >= 60% at batch 1"),
    Row("quickstart", "the quickstart's command (tiny, 1,600 steps)", "quickstart", (), _quickstart, "< 20 s"),
)


def run_row(row: Row, workdir: str, limit_s: float | None = None) -> dict:
    """The row's results (or {'error': ...}) from a process of its own, under `limit_s` (default its own)."""
    limit_s = limit_s or row.limit_s
    out = os.path.join(workdir, f"{row.key}.json")
    modules = {"bench": "transformer.bench", "attention": "transformer.bench.attention",
               "quickstart": "transformer.train"}
    command = [] if row.kind == "script" else ["-m", modules[row.kind]]
    args = [a.format(images=os.path.join(workdir, "images.npz")) for a in row.args]
    args += ["--config", "configs/gpt.py:tiny", "--workdir", os.path.join(workdir, "quickstart")] \
        if row.kind == "quickstart" else ["--json", out]
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)  # a script imports transformer
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, *command, *args], cwd=REPO, capture_output=True, text=True,
                              timeout=limit_s, env={**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false",
                                                    "PYTHONPATH": path})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {limit_s:.0f} s"}
    seconds = time.perf_counter() - start
    if done.returncode:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return {"error": f"exit {done.returncode}: {(lines or ['no output'])[-1][:300]}"}
    if row.kind == "quickstart":
        return {"seconds": seconds}
    with open(out) as f:
        return json.load(f) if row.kind in ("bench", "script") else {"rows": json.load(f)}


def fake_images(path: str, n: int = 2048) -> None:
    """ImageNet-shaped uint8 images and labels in an .npz (the ViT rows' in-memory source)."""
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.integers(0, 256, (n, 224, 224, 3), dtype=np.uint8), y=rng.integers(0, 1000, n))


def committed(path: str = RECORD) -> dict[str, str]:
    """{row key: measured} of the table in GPU.md (empty where there is none)."""
    if not os.path.exists(path):
        return {}
    rows = {}
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"[a-z][a-z0-9-]*", cells[0]) and cells[0] != "row":
            rows[cells[0]] = cells[2]
    return rows


def refuse(message: str) -> None:
    """Ends the suite in one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def run(only: list[str], record: str | None, budget_s: float | None) -> None:
    if jax.default_backend() != "gpu":
        refuse(f"the GPU suite measures an NVIDIA GPU, and this machine computes on "
               f"{jax.default_backend()} ({jax.devices()[0].device_kind})")
    unknown = set(only) - {r.key for r in ROWS}
    if unknown:
        refuse(f"--rows: unknown {', '.join(sorted(unknown))}; choose from {', '.join(r.key for r in ROWS)}")
    device, before = jax.devices()[0].device_kind, committed()
    print(f"GPU suite on {device}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        fake_images(os.path.join(workdir, "images.npz"))
        lines = measure([r for r in ROWS if not only or r.key in only], workdir, budget_s, record, device)
    print(f"\n{format_table(lines, before)}\nthe suite took {time.perf_counter() - start:.0f} s")
    if record:
        print(f"written: {record} and {os.path.splitext(record)[0]}.json")


def measure(rows, workdir: str, budget_s: float | None, record: str | None, device: str,
            clock: Callable[[], float] = time.perf_counter) -> list[tuple]:
    """[(row, text, met)] of each row in turn, within `budget_s` of `clock` if given; with `record`, the
    table and the raw results are rewritten after every row."""
    results, raw, lines, start = {}, {}, [], clock()
    for row in rows:
        t = clock()
        left = None if budget_s is None else budget_s - (t - start)
        if left is not None and left < MIN_ROW_S:
            text, met = f"not run: {budget_s:.0f} s of the suite's budget (--budget_s) were spent", None
        else:
            result = raw[row.key] = run_row(row, workdir, None if left is None else min(row.limit_s, left))
            if "error" in result:
                text, met = f"failed: {result['error']}", False
            else:
                results[row.key] = result
                text, met = row.read(result.get("rows", result), results)
        lines.append((row, text, met))
        print(f"{row.key}: {text} ({clock() - t:.0f} s)", flush=True)
        if record:
            write_record(table_for_record(lines), device, record, raw, partial=len(lines) < len(rows))
    return lines


def format_table(lines, before: dict) -> str:
    head = "| row | measured | last committed | target | met |\n| --- | --- | --- | --- | --- |\n"
    met = lambda m: "" if m is None else "yes" if m else "no"
    return head + "\n".join(f"| {row.key} | {text} | {before.get(row.key, '')} | {row.target} | {met(m)} |"
                            for row, text, m in lines)


def table_for_record(lines) -> str:
    met = lambda m: "" if m is None else "yes" if m else "no"
    return "| row | what | measured | target | met |\n| --- | --- | --- | --- | --- |\n" + "\n".join(
        f"| {row.key} | {row.what} | {text} | {row.target} | {met(m)} |" for row, text, m in lines)


def write_record(table: str, device: str, path: str = RECORD, raw: dict | None = None,
                 partial: bool = False) -> None:
    """The table into `path` (Markdown, with device, date, jax and the commit: $SUITE_COMMIT where the tree
    travelled without git, else HEAD's) and `raw` beside it as JSON."""
    commit = os.environ.get("SUITE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    so_far = " So far: the suite was still running when this was written." if partial else ""
    with open(path, "w") as f:
        f.write(f"# The GPU suite on {device} ({time.strftime('%Y-%m-%d')})\n\n"
                f"`python experiments/bench/gpu_suite.py --record` at {commit.strip() or 'an uncommitted tree'}, "
                f"jax {jax.__version__}.{so_far}\n\n{table}\n")
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(raw or {}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="", help="only these rows, comma-separated (default: all)")
    parser.add_argument("--record", nargs="?", const=RECORD, default=None, metavar="PATH",
                        help="write the measured table after each row into PATH (default: GPU.md beside this "
                             "script) and the raw results beside it as JSON")
    parser.add_argument("--budget_s", type=float, default=None,
                        help="seconds for the whole suite: rows past it are not run (default: no bound)")
    args = parser.parse_args()
    run([r for r in args.rows.split(",") if r], args.record, args.budget_s)


if __name__ == "__main__":
    main()
