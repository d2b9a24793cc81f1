"""From the chat run to preferences: DPO on synthetic pairs (the correct answer against a corrupted one) of the
chat_sft instruction set, and LoRA-SFT against full SFT on the same conversations.

  python experiments/dpo/run.py --runs /tmp/chat_exp [--dpo_steps 150 --lora_steps 200]

`--runs` holds experiments/chat_sft's outputs (`python experiments/chat_sft/run.py --out /tmp/chat_exp`): pre
(the base), sft (its full fine-tune), train.jsonl and held.jsonl (the conversations, each with its kind). The
rejected answer is the lazy one of its kind: the word unreversed, the numbers unsorted, the count plus one,
the number in decimal. Writes experiments/dpo/results.json and dpo.png; RESULTS.md holds the table.
"""

import argparse
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

from transformer import rundir  # noqa: E402
from transformer.data.text import preferences  # noqa: E402
from transformer.inference import decoding, templates  # noqa: E402
from transformer.training.tasks import dpo  # noqa: E402

SEQ_LEN = 128


def corrupted(kind: str, prompt: str, answer: str) -> str:
    """The lazy wrong answer of each kind."""
    if kind == "reverse":
        return answer[::-1]
    if kind == "sort":
        given = prompt.split(": ", 1)[1]
        return given if given != answer else " ".join(reversed(answer.split()))
    if kind == "count":
        return str(int(answer) + 1)
    return str(int(answer, 2))


def write_pairs(conversations: str, out: str) -> list[dict]:
    rows = []
    for line in open(conversations):
        row = json.loads(line)
        prompt, answer = row["messages"][:-1], row["messages"][-1]["content"]
        rejected = corrupted(row["kind"], prompt[-1]["content"], answer)
        rows.append({"prompt": prompt, "chosen": answer, "rejected": rejected, "kind": row["kind"]})
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def train(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "transformer.train", *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})


def score(workdir: str, pair_file: str, rows: list[dict], answers: int) -> dict:
    """The model's preference accuracy on the pairs (log pi(chosen) > log pi(rejected)), and by kind the share
    of its greedy answers (first `answers` prompts) equal to the chosen and to the rejected one."""
    run = rundir.open(workdir)
    model, params, chat = run.model(), run.restore_params(), templates.for_run(workdir)
    pairs = preferences.read(pair_file, SEQ_LEN + 1, chat)
    logps = {}
    for side in ("chosen", "rejected"):
        tokens, mask = getattr(pairs, side), getattr(pairs, f"{side}_mask")
        logps[side] = np.concatenate([np.asarray(dpo.sequence_logps(model, params, jnp.asarray(tokens[i:i + 50]),
                                                                    jnp.asarray(mask[i:i + 50, 1:]))[0])
                                      for i in range(0, len(pairs), 50)])
    out = {"preference_accuracy": float((logps["chosen"] > logps["rejected"]).mean())}
    kinds = {}
    for row, said in zip(rows[:answers], greedy(model, params, chat, [r["prompt"] for r in rows[:answers]])):
        k = kinds.setdefault(row["kind"], [0, 0, 0])
        k[0], k[1], k[2] = k[0] + 1, k[1] + (said == row["chosen"]), k[2] + (said == row["rejected"])
    n = sum(k[0] for k in kinds.values())
    out["answers"] = {kind: {"n": k[0], "chosen": k[1] / k[0], "rejected": k[2] / k[0]} for kind, k in kinds.items()}
    out["answers"]["all"] = {"n": n, "chosen": sum(k[1] for k in kinds.values()) / n,
                             "rejected": sum(k[2] for k in kinds.values()) / n}
    return out


def greedy(model, params, chat, prompts: list, max_new_tokens: int = 16) -> list[str]:
    """The greedy answer to each prompt (messages), prompts of one length decoded as one batch."""
    ids = [chat.prompt(p) for p in prompts]
    answers = [""] * len(prompts)
    for length in sorted({len(i) for i in ids}):
        group = [n for n, i in enumerate(ids) if len(i) == length]
        out = np.asarray(decoding.generate(model, params, jnp.asarray(np.stack([ids[n] for n in group])),
                                           jax.random.key(0), max_new_tokens=max_new_tokens, temperature=0.0,
                                           stop_id=chat.end_ids[0]))
        for n, row in zip(group, out):
            answers[n] = chat.decode(decoding.until_eos(row, chat.end_ids[0]))
    return answers


def records(workdir: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", required=True)
    p.add_argument("--out", default="")
    p.add_argument("--dpo_steps", type=int, default=150)
    p.add_argument("--lora_steps", type=int, default=200)
    p.add_argument("--answers", type=int, default=100)
    a = p.parse_args()
    out = a.out or a.runs
    pair_train, pair_held = os.path.join(out, "pairs_train.jsonl"), os.path.join(out, "pairs_held.jsonl")
    write_pairs(os.path.join(a.runs, "train.jsonl"), pair_train)
    held = write_pairs(os.path.join(a.runs, "held.jsonl"), pair_held)
    sft_dir, dpo_dir, lora_dir = (os.path.join(a.runs, "sft"), os.path.join(out, "dpo"),
                                  os.path.join(out, "lora_sft"))
    results = {"before": score(sft_dir, pair_held, held, a.answers)}
    train([f"--config=configs/dpo.py:init_from={sft_dir},data.train_path={pair_train},data.eval_path={pair_held}",
           f"--workdir={dpo_dir}", f"--config.train.steps={a.dpo_steps}", "--config.train.eval_every=25",
           "--config.train.log_every=5", f"--config.data.seq_len={SEQ_LEN}", "--config.data.batch_size=16",
           "--config.data.eval_batches=13", "--config.optim.lr=5e-4", "--config.dpo.beta=0.1",
           "--config.train.sample_tokens=0", f"--config.train.checkpoint_every={a.dpo_steps}"])
    results["after_dpo"] = score(dpo_dir, pair_held, held, a.answers)
    results["dpo_metrics"] = [r for r in records(dpo_dir) if "eval/rewards/accuracies" in r or "train/loss" in r]
    train([f"--config=configs/sft.py:init_from={os.path.join(a.runs, 'pre')},"
           f"data.train_path={os.path.join(a.runs, 'train.jsonl')},data.eval_path={os.path.join(a.runs, 'held.jsonl')}",
           f"--workdir={lora_dir}",
           f"--config.train.steps={a.lora_steps}", "--config.train.eval_every=100", "--config.train.sample_tokens=0",
           f"--config.train.checkpoint_every={a.lora_steps}", f"--config.data.seq_len={SEQ_LEN}",
           "--config.lora.rank=8", "--config.lora.targets=attention,mlp", "--config.optim.lr=1e-2"])
    for name, workdir in (("full_sft", sft_dir), ("lora_sft", lora_dir)):
        evals = [r for r in records(workdir) if "eval/loss" in r]
        results[name] = {"eval_loss": {r["step"]: r["eval/loss"] for r in evals},
                         **score(workdir, pair_held, held, a.answers)}
    json.dump(results, open(os.path.join(HERE, "results.json"), "w"), indent=1)
    plot(results)


def plot(results: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    evals = [r for r in results["dpo_metrics"] if "eval/rewards/accuracies" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    steps = [r["step"] for r in evals]
    left.plot(steps, [r["eval/rewards/accuracies"] for r in evals], "o-", label="rewards/accuracies (held out)")
    left.axhline(results["before"]["preference_accuracy"], ls="--", c="gray",
                 label="SFT model: log pi(chosen) > log pi(rejected)")
    left.set(xlabel="DPO step", ylim=(0, 1.05), title="held-out preference accuracy")
    left.legend(fontsize=7)
    right.plot(steps, [r["eval/rewards/chosen"] for r in evals], "o-", label="chosen")
    right.plot(steps, [r["eval/rewards/rejected"] for r in evals], "o-", label="rejected")
    right.set(xlabel="DPO step", title="held-out implicit rewards beta (log pi - log ref)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "dpo.png"), dpi=110)


if __name__ == "__main__":
    main()
