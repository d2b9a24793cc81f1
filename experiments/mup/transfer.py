"""Learning-rate transfer across width, with and without muP: a small GPT's eval loss against lr, a curve
per width (the figure of Yang et al. 2022).

    python -m transformer.sweep --experiment experiments/mup/transfer.py --workdir experiments/mup/sweep --parallel 2
    python experiments/mup/transfer.py experiments/mup/sweep      # draws experiments/mup/transfer.png

The committed sweep/ came from these commands (its trials' checkpoints removed); RESULTS.md says what they show.
The model is the quickstart's tiny byte-level GPT cut to 2 layers, 4 heads (their width grows with d_model),
mlp 4 x d_model, sequences of 64 bytes, batches of 8, 150 steps (15 of warmup, cosine), eval loss after the last;
each (parametrization, width) of TRIALS at its lrs: the standard parametrization, and muP
(model.parametrization=mup, base width BASE: at width d, the hidden matrices' init std and AdamW lr are
scaled by sqrt(BASE/d) and BASE/d, attention is 1/Dh, the output logits are multiplied by BASE/d). Widths 32,
128, 512 and 1024: 32x, what the 2-core CPU runs (RESULTS.md).
"""

import itertools
import os
import sys

BASE = 32  # muP's base width: the narrowest
# (parametrization, d_model) -> its learning rates
TRIALS = {  # in the order they ran
    ("sp", 32): (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2),
    ("mup", 128): (2e-3, 4e-3, 8e-3, 1.6e-2),
    ("sp", 128): (4e-3, 2e-3),
    ("mup", 32): (8e-3, 4e-3),
}
MORE = {("sp", 128): (8e-3, 1e-3), ("mup", 32): (2e-3,)}  # then these
WIDER = {  # then width 512 (16x the base), sp and muP alternating: each's predicted best first
    ("mup", 512): (8e-3, 1.6e-2, 4e-3, 3.2e-2, 2e-3, 1e-3),  # the last two: the first four's best was 4e-3
    ("sp", 512): (1e-3, 5e-4, 2e-3, 2.5e-4, 4e-3),
}
WIDEST = {  # then width 1024 (32x the base), alike: muP around the base's best, sp around its width-512 drift
    ("mup", 1024): (4e-3, 8e-3, 2e-3),
    ("sp", 1024): (2.5e-4, 5e-4, 1.25e-4),
}

CONFIG = ("configs/gpt.py:tiny,model.num_layers=2,data.seq_len=64,data.batch_size=8,train.steps=150,"
          "optim.warmup_steps=15,train.eval_every=150,train.checkpoint_every=150,train.log_every=25,"
          "train.sample_tokens=0")


def get_sweep():
    mup = {"model.parametrization": "mup", "model.mup_base_width": BASE}
    ran = [(name, d, lr) for trials in (TRIALS, MORE) for (name, d), lrs in trials.items() for lr in lrs]
    wider = []
    for group in (WIDER, WIDEST):
        columns = [[(name, d, lr) for lr in lrs] for (name, d), lrs in group.items()]
        wider += [t for row in itertools.zip_longest(*columns) for t in row if t]
    return [{**(mup if name == "mup" else {}), "model.d_model": d, "model.mlp_dim": 4 * d, "optim.lr": lr}
            for name, d, lr in ran + wider]


def best_lrs(rows: list[dict], dial: str = "model.d_model") -> dict[tuple[str, int], tuple[float, float]]:
    """(parametrization, the dial's value) -> (the lr of the lowest final eval loss, that loss), over finished
    trials."""
    best = {}
    for r in rows:
        if r.get("final eval/loss") is None:
            continue
        key = (r.get("model.parametrization") or "sp", int(r[dial]))
        if key not in best or r["final eval/loss"] < best[key][1]:
            best[key] = (float(r["optim.lr"]), float(r["final eval/loss"]))
    return best


def plot(workdir: str, path: str, dial: str = "model.d_model", titles=("standard parametrization",
                                                                        f"muP (base width {BASE})")) -> None:
    """Eval loss against lr, a curve per value of the dial (a config key); sp and muP side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from transformer.sweep import results

    rows = [r for r in results.collect(workdir) if r["final eval/loss"] is not None]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), sharey=True)
    values = sorted({int(r[dial]) for r in rows})
    colours = dict(zip(values, plt.cm.viridis([0.15 + 0.7 * i / max(len(values) - 1, 1)
                                               for i in range(len(values))])))
    for ax, name, title in zip(axes, ("sp", "mup"), titles):
        for v in values:
            points = sorted((float(r["optim.lr"]), r["final eval/loss"]) for r in rows
                            if (r.get("model.parametrization") or "sp") == name and int(r[dial]) == v)
            if points:
                ax.plot(*zip(*points), marker="o", color=colours[v], label=f"{dial.split('.')[-1]} {v}")
                lr, loss = min(points, key=lambda p: p[1])
                ax.plot([lr], [loss], marker="*", markersize=14, color=colours[v])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("optim.lr (peak)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("eval loss after 150 steps (nats per byte)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    for key, (lr, loss) in sorted(best_lrs(rows, dial).items()):
        print(f"{key[0]} {dial} {key[1]}: best lr {lr:g} (eval loss {loss:.3f})")


if __name__ == "__main__":
    plot(sys.argv[1], os.path.join(os.path.dirname(os.path.abspath(__file__)), "transfer.png"))
