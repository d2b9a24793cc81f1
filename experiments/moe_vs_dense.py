"""The tiny mixture of experts against the dense tiny GPT of the same active FLOPs per token, on the same
data (the Python standard library, bytes), steps and optimizer, for 800 and for 2,400 steps.

    python -m transformer.sweep --experiment experiments/moe_vs_dense.py --workdir /tmp/moe_vs_dense
    python experiments/moe_vs_dense.py /tmp/moe_vs_dense

The committed directory (moe_vs_dense/: results.md, curves.png, each trial's metrics) came from the same two
commands with --workdir experiments/moe_vs_dense and --parallel 1; its README.md says what the results say.

The trials are configs/gpt.py:tiny (a dense mlp of width 768 in each of its 4 Blocks) and tiny with
tiny-moe's mixture (8 experts of width 384 in each, 2 per token: the same active mlp width, 2.9 x the
parameters), each for 800 steps and for 2,400 (each run its own cosine schedule); the router adds 0.3% to the
forward FLOPs (`python -m transformer.inspect --config configs/gpt.py:tiny-moe` against :tiny). Run as a script
on the sweep's directory, this file draws compare.png (eval loss against step, against training time, and the
MoE's minus the dense model's) and writes experts.md: each expert's share of the token-slots x 8 (1 when
balanced) in each layer, over the eval batches, at each MoE trial's last checkpoint.
"""

import json
import os
import sys

DENSE = {"model.num_experts": 0, "model.mlp_dim": 768}
MOE = {"model.num_experts": 8, "model.experts_per_token": 2, "model.mlp_dim": 384}
LONGER = {"train.steps": 2400, "train.eval_every": 200}
CONFIG = "configs/gpt.py:tiny,train.steps=800,train.eval_every=100,train.checkpoint_every=400,train.sample_tokens=0"
TRIALS = {"dense, 800 steps": DENSE, "MoE, 800 steps": MOE,
          "dense, 2400 steps": {**DENSE, **LONGER}, "MoE, 2400 steps": {**MOE, **LONGER}}


def get_sweep():
    return list(TRIALS.values())


def expert_loads(trial_dir: str):
    """[layers, E]: each expert's share of the token-slots x E over the run's eval batches, at its last
    checkpoint."""
    import jax
    import numpy as np

    from transformer import rundir
    from transformer.layers import moe
    from transformer.models import common
    from transformer.training import checks, loop, tasks

    run = rundir.open(trial_dir)
    step = run.checkpoint_step(None)
    task_name = checks.checked(run.config, resolve=False).task
    _, rows = loop.prepare(run.config)
    task = tasks.build(run.config, trial_dir, task_name, rows, step)
    model, params = run.model(), run.restore_params(step)
    loads = []
    for batch in task.eval_batches():
        with common.sowing() as sown:
            task.eval_outputs(model, params, batch)
        loads.append(jax.device_get(moe.collect(sown)["load"]))
    return step, np.mean(loads, axis=0) * run.config.model.num_experts


def write_experts(workdir: str) -> None:
    from transformer.sweep import experiments

    lines = ["# Expert load at the last step (eval batches)", "",
             "Each expert's share of the token-slots x 8 (1 when balanced; 8 would be every slot)."]
    for label, overrides in TRIALS.items():
        if overrides["model.num_experts"]:
            step, loads = expert_loads(os.path.join(workdir, "trials", experiments.trial_name(overrides)))
            lines += ["", f"## {label}: step {step}", "",
                      "| layer | " + " | ".join(f"expert {e}" for e in range(loads.shape[1])) + " | max | min |",
                      "|---|" + "---|" * (loads.shape[1] + 2)]
            lines += [f"| {i} | " + " | ".join(f"{x:.2f}" for x in row) + f" | {row.max():.2f} | {row.min():.2f} |"
                      for i, row in enumerate(loads)]
    with open(os.path.join(workdir, "experts.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def plot_compare(workdir: str) -> None:
    """Eval loss against step, against training time (the steps' own time, from train/tokens_per_s: evals
    and checkpoints left out) and the MoE's eval loss minus the dense model's at each step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from transformer.sweep import experiments, results

    fig, (by_step, by_time, gap) = plt.subplots(1, 3, figsize=(16, 4))
    evals = {}
    for label, overrides in TRIALS.items():
        trial = results.trial_dir(workdir, experiments.trial_name(overrides))
        style = dict(color="C1" if overrides["model.num_experts"] else "C0",
                     linestyle="-" if "train.steps" in overrides else "--")
        records = results.records_of(trial)
        with open(os.path.join(trial, "config.json")) as f:
            data = json.load(f)["data"]
        seconds, elapsed, last = {}, 0.0, 0
        for r in records:
            if "train/tokens_per_s" in r:
                elapsed += (r["step"] - last) * data["batch_size"] * data["seq_len"] / r["train/tokens_per_s"]
                seconds[r["step"]], last = elapsed, r["step"]
        evals[label] = {r["step"]: r["eval/loss"] for r in records if "eval/loss" in r}
        by_step.plot(list(evals[label]), list(evals[label].values()), marker=".", label=label, **style)
        by_time.plot([seconds[s] for s in evals[label]], list(evals[label].values()), marker=".", label=label,
                     **style)
    for steps, style in (("800", "--"), ("2400", "-")):
        dense, mixture = evals[f"dense, {steps} steps"], evals[f"MoE, {steps} steps"]
        shared = [s for s in dense if s in mixture]
        gap.plot(shared, [mixture[s] - dense[s] for s in shared], marker=".", color="C2", linestyle=style,
                 label=f"{steps} steps")
    gap.axhline(0, color="grey", linewidth=0.8)
    by_step.set_xlabel("step")
    by_time.set_xlabel("training time with compilation, s (2-core CPU, shared)")
    gap.set_xlabel("step")
    for ax in (by_step, by_time):
        ax.set_ylabel("eval loss (nats per byte)")
    gap.set_ylabel("eval loss, MoE - dense")
    for ax in (by_step, by_time, gap):
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "compare.png"), dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    plot_compare(sys.argv[1])
    write_experts(sys.argv[1])
