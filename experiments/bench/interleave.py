"""Training tokens/s of two commits, interleaved: did a change make the default path slower?

  python experiments/bench/interleave.py --base 2689d69 --configs configs/gpt.py:tiny \
      configs/gpt.py:gpt2-small,data.batch_size=2,data.seq_len=256 --rounds 5 --steps 5

Each round runs `python -m transformer.bench --mode train` once on the base commit (a git
worktree) and once on the working tree, alternately, so that the machine's load drifts over
both alike. It prints every round's tokens/s and, per config, the ratio of the medians
(working tree / base); results go to a JSON file.
"""

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = re.compile(r"^ours: ([\d,.]+) tokens/s", re.MULTILINE)


@contextlib.contextmanager
def worktree(commit: str):
    """A detached git worktree of `commit` at /tmp/interleave-COMMIT, removed afterwards (one already
    there is used and left as it was)."""
    path = f"/tmp/interleave-{commit}"
    made = not os.path.isdir(path)
    if made:
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", path, commit], check=True,
                       capture_output=True)
    try:
        yield path
    finally:
        if made:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", path], capture_output=True)


def tokens_per_second(tree: str, config: str, steps: int) -> float:
    out = subprocess.run([sys.executable, "-m", "transformer.bench", "--config", os.path.join(tree, config),
                          "--steps", str(steps), "--mode", "train"], cwd=tree, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": tree})
    found = TOKENS.search(out.stdout + out.stderr)
    if not found:
        raise RuntimeError(f"no tokens/s in the bench output of {tree}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return float(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--configs", nargs="+", default=["configs/gpt.py:tiny"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(REPO, "experiments/bench/interleave.json"))
    args = parser.parse_args()
    with worktree(args.base) as base:
        compare({"base": base, "new": REPO}, args)


def compare(trees: dict, args) -> None:
    """Runs each config's interleaved rounds in the two trees; prints and writes the results."""
    results = {}
    for config in args.configs:
        runs = {"base": [], "new": []}
        for r in range(args.rounds):
            for name in ("base", "new") if r % 2 == 0 else ("new", "base"):
                runs[name].append(tokens_per_second(trees[name], config, args.steps))
            print(f"{config} round {r}: base {runs['base'][-1]:,.0f}  new {runs['new'][-1]:,.0f} tokens/s", flush=True)
        ratio = statistics.median(runs["new"]) / statistics.median(runs["base"])
        results[config] = {**runs, "ratio_of_medians": ratio}
        print(f"{config}: new / base = {ratio:.3f} (medians of {args.rounds})", flush=True)
        with open(args.out, "w") as f:
            json.dump({"base": args.base, "rounds": args.rounds, "steps": args.steps, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
