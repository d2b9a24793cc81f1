"""GPT learning rate x width on the embedded text (the Python standard library, bytes).

To reproduce the results, run the sweep into a fresh workdir and compare its results.md with
the committed gpt_lr_width/results.md:

    python -m transformer.sweep --experiment experiments/gpt_lr_width.py \
        --workdir /tmp/gpt_lr_width --parallel 2

The committed directory came from the same command on it; its trials are finished (a rerun
only rewrites the results), so regenerate it with

    rm -r experiments/gpt_lr_width/trials
    python -m transformer.sweep --experiment experiments/gpt_lr_width.py \
        --workdir experiments/gpt_lr_width --parallel 2

The tiny GPT (4 layers, byte-level, sequence 128, batch 16) for 600 steps at three
learning rates and two widths; eval loss in nats per byte. Results: gpt_lr_width/results.md.

Measured 2026-11-21 on a 2-core CPU (10 min on a quiet machine, two trials at a time): 3e-3
is best at both widths (eval 2.001 at width 128, 1.915 at 192); 1e-2 is worst at width 192
(2.640) and 1e-3 is too slow for 600 steps. The wider model wins at 1e-3 and 3e-3. A rerun
reproduces the 1e-3 and 3e-3 trials to 4 digits; the 1e-2 trials, at the edge of
stability, move by a few hundredths when the floating-point summation order changes (the
results before the blocked causal attention of the bench work had 2.299 and 2.585).
"""

from transformer import sweep

CONFIG = "configs/gpt.py:tiny,train.steps=600,train.eval_every=200,train.checkpoint_every=200,train.sample_tokens=0"


def get_sweep():
    return sweep.grid({"model.d_model": [128, 192], "optim.lr": [1e-3, 3e-3, 1e-2]})
