"""Muon against AdamW on the quickstart's model (the tiny GPT, bytes of the Python standard library), each at
a swept learning rate, the same 600 steps, warmup and cosine schedule.

    python -m transformer.sweep --experiment experiments/muon_vs_adamw.py --workdir /tmp/muon_vs_adamw
    python experiments/muon_vs_adamw.py /tmp/muon_vs_adamw

The committed directory (muon_vs_adamw/: results.md, curves.png, each trial's metrics) came from the same
commands with --workdir experiments/muon_vs_adamw --parallel 1; its README.md says what the results say. Run as
a script on the sweep's directory, this file draws lr.png: the final eval loss against lr, a line per optimizer.

Muon orthogonalises the momentum of the hidden weight matrices (optax's scale_by_muon, its update RMS matched to
AdamW's, `optim.muon_rms=0.2`, so one lr scale serves both); the embeddings, the head, norms and biases take
AdamW at the same lr. Both take lr 1e-3, 3e-3 and 1e-2; Muon, best at the top of that range, 3e-2 too.
"""

import os
import sys

from transformer import sweep

CONFIG = "configs/gpt.py:tiny,train.steps=600,train.eval_every=200,train.checkpoint_every=200,train.sample_tokens=0"


def get_sweep():
    both = sweep.grid({"optim.optimizer": ["adamw", "muon"], "optim.lr": [1e-3, 3e-3, 1e-2]})
    return both + [{"optim.optimizer": "muon", "optim.lr": 3e-2}]


def plot_lr(workdir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from transformer.sweep import results

    rows = results.collect(workdir)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for optimizer in ("adamw", "muon"):
        points = sorted((r["optim.lr"], r["final eval/loss"]) for r in rows
                        if r["optim.optimizer"] == optimizer and r["final eval/loss"] is not None)
        ax.plot([lr for lr, _ in points], [loss for _, loss in points], marker="o", label=optimizer)
    ax.set_xscale("log")
    ax.set_xlabel("optim.lr (peak)")
    ax.set_ylabel("eval loss at step 600 (nats per byte)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "lr.png"), dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    plot_lr(sys.argv[1])
