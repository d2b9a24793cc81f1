"""The table of experiments/imagegpt: eval loss (nats per pixel) against the palette's unigram entropy at
each eval, then the linear probe per layer beside raw pixels.

  python experiments/imagegpt/summarize.py runs/igpt-tiny experiments/imagegpt/probe.json \
      > experiments/imagegpt/table.md
"""

import json
import os
import sys

from transformer.training import metrics


def main(workdir: str, probe_json: str) -> None:
    evals = [r for r in metrics.read(os.path.join(workdir, "metrics.jsonl")) if "eval/loss" in r]
    print("| step | eval loss (nats/pixel) | bits/pixel | unigram entropy (nats/pixel) | loss / entropy |")
    print("|---|---|---|---|---|")
    for r in evals:
        print(f"| {r['step']} | {r['eval/loss']:.4f} | {r['eval/bits_per_pixel']:.4f} | "
              f"{r['eval/unigram_entropy']:.4f} | {r['eval/loss'] / r['eval/unigram_entropy']:.3f} |")
    with open(probe_json) as f:
        probe = json.load(f)
    print(f"\nLinear probe at step {probe['step']} ({probe['train_images']:,} train / {probe['test_images']:,} "
          "held-out images; logistic regression on standardised features):\n")
    print("| features | held-out accuracy |\n|---|---|")
    for name, acc in zip(probe["layers"], probe["accuracy"]):
        print(f"| {name}{' (best)' if name == probe['best'] else ''} | {acc:.4f} |")
    print(f"| raw pixels | {probe['pixels']:.4f} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
