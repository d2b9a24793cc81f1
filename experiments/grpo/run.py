"""GRPO on a verifiable task: a tiny byte GPT (the chat_sft study's pretrained run) fine-tuned briefly on
generated two-number additions (task=sft), then trained with GRPO (task=grpo, reward: exact match of the
sum); held-out exact match through lm-evaluation-harness before and after, the rollouts' share of time.

  python experiments/grpo/run.py --pre /tmp/chat_exp/pre --out /tmp/grpo_exp [--sft_steps 60 --grpo_steps 40]

--pre is a pretrained run (experiments/chat_sft/run.py makes one: configs/gpt.py:tiny on the stdlib bytes).
Writes experiments/grpo/results.json, curves.png and the harness task's data (tasks/held_prompts.jsonl).
"""

import argparse
import json
import os
import random
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def write_sets(out: str, held: int, high: int) -> list[str]:
    """Every 'What is a + b?' with a, b < high: `held` of them held out (also the harness task's file), the
    rest as SFT conversations and as GRPO prompts with their answer."""
    pairs = [(a, b) for a in range(high) for b in range(high)]
    random.Random(0).shuffle(pairs)
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]
    paths = [os.path.join(out, name) for name in ("sft.jsonl", "prompts.jsonl", "held.jsonl", "held_sft.jsonl")]
    for path, part in ((paths[0], rows[held:]), (paths[3], rows[:held])):
        with open(path, "w") as f:
            f.writelines(json.dumps({"prompt": r["prompt"], "completion": r["answer"]}) + "\n" for r in part)
    with open(paths[1], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[held:])
    for path in (paths[2], os.path.join(HERE, "tasks", "held_prompts.jsonl")):
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[:held])
    return paths


def run(module: str, *args: str) -> str:
    command = [sys.executable, "-m", f"transformer.{module}", *args]
    print("$", " ".join(command), flush=True)
    env = {**os.environ, "PYTHONPATH": REPO, "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(command, check=True, cwd=REPO, env=env, capture_output=module == "evaluate",
                          text=True).stdout


def harness(workdir: str) -> float:
    out = run("evaluate", "--workdir", workdir, "--tasks", "grpo_arith_held", "--include_path",
              os.path.join(HERE, "tasks"), "--apply_chat_template")
    print(out)
    row = next(line for line in out.splitlines() if line.startswith("|grpo_arith_held"))
    return float(row.split("|")[7])  # the table's Value column


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pre", default="/tmp/chat_exp/pre")
    parser.add_argument("--out", default="/tmp/grpo_exp")
    parser.add_argument("--sft_steps", type=int, default=250)
    parser.add_argument("--grpo_steps", type=int, default=400)
    parser.add_argument("--held", type=int, default=80)
    parser.add_argument("--high", type=int, default=20, help="operands in [0, high)")
    parser.add_argument("--grpo_lr", type=float, default=3e-5)
    parser.add_argument("--grpo_batch", type=int, default=128, help="rollouts per step (prompts x group)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--updates_per_rollout", type=int, default=1)
    parser.add_argument("--kl_weight", type=float, default=0.0)
    parser.add_argument("--eval_every", type=int, default=50)
    parser.add_argument("--grpo_dir", default="grpo", help="the GRPO run's folder under --out")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sft_data, prompts, held, held_sft = write_sets(args.out, args.held, args.high)
    sft, grpo = os.path.join(args.out, "sft"), os.path.join(args.out, args.grpo_dir)
    if not os.path.isdir(os.path.join(sft, "checkpoints", str(args.sft_steps))):
        run("train", "--config", f"configs/sft.py:init_from={args.pre},data.train_path={sft_data},"
            f"data.eval_path={held_sft}", "--workdir", sft, f"--config.train.steps={args.sft_steps}",
            f"--config.train.eval_every={args.sft_steps}", f"--config.train.checkpoint_every={args.sft_steps}",
            "--config.train.log_every=10", "--config.data.seq_len=64", "--config.data.batch_size=16",
            "--config.data.eval_batches=2", "--config.optim.warmup_steps=10", "--config.optim.lr=1e-3")
    run("train", "--config", f"configs/grpo.py:init_from={sft},data.train_path={prompts},data.eval_path={held}",
        "--workdir", grpo, f"--config.train.steps={args.grpo_steps}", f"--config.train.eval_every={args.eval_every}",
        f"--config.train.checkpoint_every={args.eval_every}", "--config.train.log_every=10", "--config.data.seq_len=40",
        f"--config.data.batch_size={args.grpo_batch}", f"--config.grpo.group_size={args.group}",
        f"--config.grpo.updates_per_rollout={args.updates_per_rollout}", f"--config.grpo.kl_weight={args.kl_weight}",
        "--config.grpo.max_new_tokens=4",
        "--config.grpo.rewards=exact_match", "--config.grpo.eval_prompts=100", f"--config.optim.lr={args.grpo_lr}",
        "--config.optim.warmup_steps=5")
    results = {"harness_exact_match": {"sft": harness(sft), "grpo": harness(grpo)},
               "eval_rollouts": list({r["step"]: r for r in map(json.loads, open(os.path.join(grpo, "rollouts",
                                                                                     "eval.jsonl")))}.values()),
               "train": [json.loads(line) for line in open(os.path.join(grpo, "metrics.jsonl"))],
               "args": vars(args)}
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results)
    print(json.dumps(results["harness_exact_match"]))


def plot(results: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in results["train"] if "train/reward" in r]
    evals = results["eval_rollouts"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    axes[0].plot([r["step"] for r in train], [r["train/reward"] for r in train], label="train reward (sampled)")
    axes[0].plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", label="held-out accuracy (greedy)")
    axes[0].axhline(results["harness_exact_match"]["sft"], color="gray", ls="--", label="SFT start (harness)")
    axes[0].set_xlabel("GRPO step")
    axes[0].legend()
    axes[1].plot([r["step"] for r in train], [r["train/entropy"] for r in train], label="entropy (nats/token)")
    axes[1].plot([r["step"] for r in train], [r["train/completion_length"] for r in train], label="completion length")
    axes[1].set_xlabel("GRPO step")
    axes[1].legend()
    axes[2].plot([r["step"] for r in train], [r["train/rollout_share"] for r in train], label="rollout share")
    axes[2].plot([r["step"] for r in train], [r["train/clip_fraction"] for r in train], label="clip fraction")
    axes[2].set_xlabel("GRPO step")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "curves.png"), dpi=90)


if __name__ == "__main__":
    main()
