"""Learning-rate transfer across width, with and without muP: a small GPT's eval loss against lr, a curve
per width (the figure of Yang et al. 2022).

    python -m transformer.sweep --experiment experiments/mup/transfer.py --workdir experiments/mup/sweep --parallel 2
    python experiments/mup/transfer.py experiments/mup/sweep      # draws experiments/mup/transfer.png

The committed sweep/ came from these commands (its trials' checkpoints removed); RESULTS.md says what they show.
The model is the quickstart's tiny byte-level GPT cut to 2 layers, 4 heads (their width grows with d_model),
mlp 4 x d_model, sequences of 64 bytes, batches of 8, 150 steps (15 of warmup, cosine), eval loss after the last;
each (parametrization, width) of TRIALS at its lrs: the standard parametrization, and muP
(model.parametrization=mup, base width BASE: at width d, the hidden matrices' init std and AdamW lr are
scaled by sqrt(BASE/d) and BASE/d, attention is 1/Dh, the output logits are multiplied by BASE/d). Widths 32 and
128 only: what the loaded 2-core CPU allowed (RESULTS.md).
"""

import os
import sys

BASE = 32  # muP's base width: the narrowest
# (parametrization, d_model) -> its learning rates: the 2-core CPU, shared and loaded, allowed these
TRIALS = {  # in the order they ran
    ("sp", 32): (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2),
    ("mup", 128): (2e-3, 4e-3, 8e-3, 1.6e-2),
    ("sp", 128): (4e-3, 2e-3),
    ("mup", 32): (8e-3, 4e-3),
}
MORE = {("sp", 128): (8e-3, 1e-3), ("mup", 32): (2e-3,)}  # then these (the last to run)

CONFIG = ("configs/gpt.py:tiny,model.num_layers=2,data.seq_len=64,data.batch_size=8,train.steps=150,"
          "optim.warmup_steps=15,train.eval_every=150,train.checkpoint_every=150,train.log_every=25,"
          "train.sample_tokens=0")


def get_sweep():
    mup = {"model.parametrization": "mup", "model.mup_base_width": BASE}
    return [{**(mup if name == "mup" else {}), "model.d_model": d, "model.mlp_dim": 4 * d, "optim.lr": lr}
            for trials in (TRIALS, MORE) for (name, d), lrs in trials.items() for lr in lrs]


def best_lrs(rows: list[dict]) -> dict[tuple[str, int], tuple[float, float]]:
    """(parametrization, d_model) -> (the lr of the lowest final eval loss, that loss), over finished trials."""
    best = {}
    for r in rows:
        if r.get("final eval/loss") is None:
            continue
        key = (r.get("model.parametrization") or "sp", int(r["model.d_model"]))
        if key not in best or r["final eval/loss"] < best[key][1]:
            best[key] = (float(r["optim.lr"]), float(r["final eval/loss"]))
    return best


def plot(workdir: str, path: str) -> None:
    """Eval loss against lr, a curve per width; sp and muP side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from transformer.sweep import results

    rows = results.collect(workdir)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), sharey=True)
    widths = sorted({d for _, d in TRIALS})
    colours = dict(zip(widths, plt.cm.viridis([0.15 + 0.7 * i / max(len(widths) - 1, 1)
                                               for i in range(len(widths))])))
    for ax, name in zip(axes, ("sp", "mup")):
        for d in widths:
            points = sorted((float(r["optim.lr"]), r["final eval/loss"]) for r in rows
                            if (r.get("model.parametrization") or "sp") == name and int(r["model.d_model"]) == d
                            and r["final eval/loss"] is not None)
            if points:
                ax.plot(*zip(*points), marker="o", color=colours[d], label=f"d_model {d}")
                lr, loss = min(points, key=lambda p: p[1])
                ax.plot([lr], [loss], marker="*", markersize=14, color=colours[d])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("optim.lr (peak)")
        ax.set_title({"sp": "standard parametrization", "mup": f"muP (base width {BASE})"}[name])
        ax.legend(fontsize=8)
    axes[0].set_ylabel("eval loss after 150 steps (nats per byte)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    for key, (lr, loss) in sorted(best_lrs(rows).items()):
        print(f"{key[0]} d_model {key[1]}: best lr {lr:g} (eval loss {loss:.3f})")


if __name__ == "__main__":
    plot(sys.argv[1], os.path.join(os.path.dirname(os.path.abspath(__file__)), "transfer.png"))
