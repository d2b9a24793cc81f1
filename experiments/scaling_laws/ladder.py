"""A miniature IsoFLOP ladder: tiny byte-level GPTs (2 layers, widths 4 to 24) at three compute budgets,
each trained for the steps that spend its budget, on the embedded text (the Python standard library).

    python -m transformer.sweep --experiment experiments/scaling_laws/ladder.py \
        --workdir experiments/scaling_laws/ladder --parallel 2
    python -m transformer.report experiments/scaling_laws/ladder --scaling --target_flops 1e12

The grid comes from the model's own FLOP count (transformer/sweep/isoflop.py): at each budget 4 to 6 widths
around its optimum (the window moves up with the budget, as Chinchilla's ladder moves its sizes); the steps
of a trial = budget / training FLOPs per step (sequence 64, batch 16: 1,024 tokens a step); the warmup is a
twentieth of the run, the cosine schedule its length, one eval at the end over 32 batches.
Results, the fits and their uncertainty: RESULTS.md beside this file.
"""

from transformer.sweep import isoflop

CONFIG = ("configs/gpt.py:tiny,model.num_layers=2,data.seq_len=64,data.eval_batches=32,train.log_every=25,"
          "train.eval_every=100000,train.checkpoint_every=100000,train.sample_tokens=0")
# training FLOPs of a run -> the widths trained at it (heads of width 8, or one head; MLP 4 x the width)
LADDER = {6.7e9: [4, 6, 8, 12], 2e10: [4, 6, 8, 12, 16, 24], 6e10: [8, 12, 16, 24]}


def size(width: int) -> dict:
    return {"model.d_model": width, "model.num_heads": max(1, width // 8), "model.mlp_dim": 4 * width}


def get_sweep():
    warmup = lambda steps: {"optim.warmup_steps": max(1, steps // 20)}  # noqa: E731
    return [trial for budget, widths in LADDER.items()
            for trial in isoflop.grid(CONFIG, [budget], [size(w) for w in widths], extra=warmup)]
