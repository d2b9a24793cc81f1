"""DPO on the SFT model's own mistakes (on-policy preference pairs) of the chat_sft instruction set: do the
greedy answers to held-out prompts move toward the correct ones? And LoRA-SFT against full SFT.

  python experiments/dpo/run.py --runs /tmp/chatA --out /tmp/dpo_on [--prompts 4000 --samples 4 --dpo_steps 150]
      [--lr 1e-4 --beta 0.1 --rejected any|greedy] [--test 300] [--lora_steps 401]

`--runs` holds experiments/chat_sft's outputs (`python experiments/chat_sft/run.py --out /tmp/chatA`): pre
(the base), sft (its full fine-tune), train.jsonl and held.jsonl (the conversations, each with its kind).

The pairs are on-policy, as in the literature (the SFT model's samples, ranked; here by exact match): the SFT
model answers each of the first `--prompts` training prompts greedily and `--samples` times at temperature 1
(`inference.rollouts.sample`, the RL tasks' sampler); a prompt it gets wrong gives one pair, chosen = the
correct answer, rejected = its own wrong answer (the greedy one if that is wrong, else the first wrong
sample). The held-out prompts give the eval pairs the same way. DPO then runs from the SFT run
(`transformer.train`, configs/dpo.py), and the held-out greedy answers are scored before and after: exact
match by kind, and how often the answer is still the SFT model's own wrong greedy answer (the rejected kind).
Writes experiments/dpo/results.json and dpo.png; RESULTS.md holds the table.
"""

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

from transformer import rundir  # noqa: E402
from transformer.data.text import chat_templates as templates  # noqa: E402
from transformer.inference import rollouts  # noqa: E402

SEQ_LEN = 96  # the longest prompt (71 tokens) and answer fit
MAX_NEW = 12
KINDS = ("reverse", "sort", "count", "upper", "binary")


def conversations(path: str, n: int = 0) -> list[dict]:
    rows = [json.loads(line) for line in open(path)]
    return rows[:n] if n else rows


def answers(workdir: str, rows: list[dict], samples: int, seed: int = 0) -> tuple[list[str], list[list[str]]]:
    """(the greedy answer to each conversation's prompt, its `samples` answers at temperature 1)."""
    run = rundir.open(workdir)
    model, params, chat = run.model(), run.restore_params(), templates.for_run(workdir)
    prompts = [chat.prompt(r["messages"][:-1]) for r in rows]
    stop = chat.end_ids[0]

    def texts(out: rollouts.Rollouts) -> list[str]:
        return [chat.decode(row[:int(m.sum())][row[:int(m.sum())] != stop]).strip()
                for row, m in zip(out.completions, out.mask)]

    greedy = texts(rollouts.sample(model, params, prompts, 1, jax.random.key(seed), max_new_tokens=MAX_NEW,
                                   temperature=0.0, stop_id=stop))
    if not samples:
        return greedy, [[] for _ in rows]
    drawn = texts(rollouts.sample(model, params, prompts, samples, jax.random.key(seed + 1),
                                  max_new_tokens=MAX_NEW, temperature=1.0, stop_id=stop))
    return greedy, [drawn[i * samples:(i + 1) * samples] for i in range(len(rows))]


def fresh(runs: str, n: int, seed: int = 1) -> list[dict]:
    """`n` new conversations of chat_sft's instruction set, none of whose prompts is in train.jsonl or
    held.jsonl (a test set drawn after the DPO settings were chosen)."""
    spec = importlib.util.spec_from_file_location("chat_sft", os.path.join(REPO, "experiments/chat_sft/run.py"))
    chat_sft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chat_sft)
    seen = {r["messages"][-2]["content"] for split in ("train", "held")
            for r in conversations(os.path.join(runs, f"{split}.jsonl"))}
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        kind = rng.choice(KINDS)
        prompt, answer = chat_sft.instruction(kind, rng)
        system = [{"role": "system", "content": "Answer with the result only."}] if rng.random() < 0.5 else []
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"messages": [*system, {"role": "user", "content": prompt},
                                      {"role": "assistant", "content": answer}], "kind": kind})
    return rows


def write_pairs(rows: list[dict], greedy: list[str], sampled: list[list[str]], path: str) -> list[dict]:
    """One pair per prompt the model gets wrong (greedily, else in a sample): chosen the correct answer,
    rejected the model's own wrong one."""
    pairs = []
    for row, g, s in zip(rows, greedy, sampled):
        right = row["messages"][-1]["content"]
        wrong = [a for a in [g, *s] if a and a != right]
        if wrong:
            pairs.append({"prompt": row["messages"][:-1], "chosen": right, "rejected": wrong[0],
                          "kind": row["kind"], "source": "greedy" if wrong[0] == g else "sampled"})
    with open(path, "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in pairs)
    return pairs


def exact_match(rows: list[dict], said: list[str], before: list[str] | None = None) -> dict:
    """By kind and in all: the share of greedy answers equal to the correct one; with `before` (the SFT
    model's greedy answers), the share of the prompts it got wrong still answered with its own wrong answer,
    and the counts fixed (wrong before, right now) and broken (right before, wrong now)."""
    out = {}
    for kind in (*KINDS, "all"):
        index = [i for i, r in enumerate(rows) if kind in ("all", r["kind"])]
        if not index:
            continue
        right = [said[i] == rows[i]["messages"][-1]["content"] for i in index]
        entry = {"n": len(index), "exact_match": float(np.mean(right))}
        if before is not None:
            was = [before[i] == rows[i]["messages"][-1]["content"] for i in index]
            wrong = [i for i, w in zip(index, was) if not w]
            entry |= {"wrong_before": len(wrong),
                      "same_wrong_answer": float(np.mean([said[i] == before[i] for i in wrong])) if wrong else None,
                      "fixed": int(sum(r and not w for r, w in zip(right, was))),
                      "broken": int(sum(w and not r for r, w in zip(right, was)))}
        out[kind] = entry
    return out


def train(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "transformer.train", *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})


def records(workdir: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def dpo(a, sft_dir: str, pair_train: str, pair_held: str, n_held: int, workdir: str) -> None:
    train([f"--config=configs/dpo.py:init_from={sft_dir},data.train_path={pair_train},data.eval_path={pair_held}",
           f"--workdir={workdir}", f"--config.train.steps={a.dpo_steps}",
           f"--config.train.eval_every={max(a.dpo_steps // 6, 1)}", "--config.train.log_every=5",
           f"--config.data.seq_len={SEQ_LEN}", "--config.data.batch_size=16",
           f"--config.data.eval_batches={-(-n_held // 16)}", f"--config.optim.lr={a.lr}",
           f"--config.dpo.beta={a.beta}", "--config.train.sample_tokens=0",
           f"--config.train.checkpoint_every={a.dpo_steps}"])


def lora_sft(a, out: str) -> dict:
    """LoRA-SFT from the base on the same conversations: its held-out loss and greedy exact match."""
    workdir = os.path.join(out, "lora_sft")
    train([f"--config=configs/sft.py:init_from={os.path.join(a.runs, 'pre')},"
           f"data.train_path={os.path.join(a.runs, 'train.jsonl')},data.eval_path={os.path.join(a.runs, 'held.jsonl')}",
           f"--workdir={workdir}", f"--config.train.steps={a.lora_steps}",
           f"--config.train.eval_every={a.lora_steps // 2}", "--config.train.sample_tokens=0",
           f"--config.train.checkpoint_every={a.lora_steps}", "--config.data.seq_len=128",
           "--config.lora.rank=8", "--config.lora.targets=attention,mlp", "--config.optim.lr=1e-2"])
    held = conversations(os.path.join(a.runs, "held.jsonl"))
    evals = [r for r in records(workdir) if "eval/loss" in r]
    return {"steps": a.lora_steps, "eval_loss": {r["step"]: r["eval/loss"] for r in evals},
            "held": exact_match(held, answers(workdir, held, 0)[0])}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", required=True, help="experiments/chat_sft's --out: pre, sft, train.jsonl, held.jsonl")
    p.add_argument("--out", required=True, help="where the pairs and the DPO run go")
    p.add_argument("--prompts", type=int, default=4000, help="training prompts the SFT model answers")
    p.add_argument("--samples", type=int, default=4, help="answers sampled at temperature 1 per prompt")
    p.add_argument("--dpo_steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--rejected", choices=("any", "greedy"), default="any",
                   help="greedy: pairs only where the greedy answer is wrong (no sampled mistakes)")
    p.add_argument("--test", type=int, default=0, help="also score SFT and DPO on this many fresh prompts")
    p.add_argument("--lora_steps", type=int, default=0, help="0: keep results.json's LoRA-SFT numbers")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    sft_dir = os.path.join(a.runs, "sft")
    train_rows = conversations(os.path.join(a.runs, "train.jsonl"), a.prompts)
    held = conversations(os.path.join(a.runs, "held.jsonl"))
    cache = os.path.join(a.out, f"sft_answers_{a.prompts}x{a.samples}.json")
    if not os.path.isfile(cache):  # the SFT model's answers: the same for every DPO setting
        json.dump([*answers(sft_dir, train_rows, a.samples), *answers(sft_dir, held, a.samples)], open(cache, "w"))
    g_train, s_train, g_held, s_held = json.load(open(cache))
    if a.rejected == "greedy":
        s_train, s_held = [[] for _ in s_train], [[] for _ in s_held]
    tag = f"lr{a.lr:g}_beta{a.beta:g}" + ("_greedy" if a.rejected == "greedy" else "")
    pair_train, pair_held = (os.path.join(a.out, f"pairs_{split}_{a.rejected}.jsonl") for split in ("train", "held"))
    pairs = write_pairs(train_rows, g_train, s_train, pair_train)
    held_pairs = write_pairs(held, g_held, s_held, pair_held)
    dpo_dir = os.path.join(a.out, f"dpo_{tag}")
    if not os.path.isdir(os.path.join(dpo_dir, "checkpoints", str(a.dpo_steps))):
        dpo(a, sft_dir, pair_train, pair_held, len(held_pairs), dpo_dir)
    after = answers(dpo_dir, held, 0)[0]
    path = os.path.join(HERE, "results.json")
    results = json.load(open(path)) if os.path.isfile(path) else {}
    results = {k: v for k, v in results.items() if k in ("lora_sft", "full_sft", "runs", "harness_exact_match")}
    runs = results.get("runs", {})
    runs[tag] = {**runs.get(tag, {}),  # a fresh test set scored before stays
        "command": " ".join(sys.argv), "rejected": a.rejected, "lr": a.lr, "beta": a.beta, "dpo_steps": a.dpo_steps,
        "pairs": {"train": len(pairs), "train_prompts": len(train_rows),
                  "train_greedy_wrong": sum(p["source"] == "greedy" for p in pairs),
                  "train_by_kind": {k: sum(p["kind"] == k for p in pairs) for k in KINDS},
                  "held": len(held_pairs), "held_greedy_wrong": sum(p["source"] == "greedy" for p in held_pairs)},
        "train_exact_match_sft": exact_match(train_rows, g_train)["all"]["exact_match"],
        "before": exact_match(held, g_held), "after": exact_match(held, after, g_held),
        "examples": [[r["messages"][-2]["content"], r["messages"][-1]["content"], b, s]
                     for r, b, s in zip(held, g_held, after) if b != s][:12],
        "dpo_metrics": [r for r in records(dpo_dir) if "eval/rewards/accuracies" in r or "train/loss" in r]}
    if a.test:
        test = fresh(a.runs, a.test)
        cache = os.path.join(a.out, f"sft_answers_test{a.test}.json")
        if not os.path.isfile(cache):
            json.dump(answers(sft_dir, test, 0)[0], open(cache, "w"))
        before = json.load(open(cache))
        runs[tag]["test"] = {"before": exact_match(test, before),
                             "after": exact_match(test, answers(dpo_dir, test, 0)[0], before)}
    results["runs"] = runs
    if a.lora_steps:
        results["lora_sft"] = lora_sft(a, a.out)
    json.dump(results, open(path, "w"), indent=1)
    plot(runs)
    print(json.dumps({k: {"before": v["before"]["all"], "after": v["after"]["all"]} for k, v in runs.items()},
                     indent=1))


def plot(runs: dict) -> None:
    """Held-out rewards/accuracies by DPO step (each run), and exact match by kind before and after."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": (1, 1.5)})
    names = [*KINDS, "all"]
    x, width = np.arange(len(names)), 0.85 / (1 + len(runs))
    first = next(iter(runs.values()))
    right.bar(x, [first["before"][n]["exact_match"] for n in names], width, color="0.4", label="SFT (DPO's start)")
    for i, (tag, run) in enumerate(runs.items(), 1):
        evals = [r for r in run["dpo_metrics"] if "eval/rewards/accuracies" in r]
        left.plot([r["step"] for r in evals], [r["eval/rewards/accuracies"] for r in evals], "o-", c=f"C{i}",
                  label=tag)
        right.bar(x + i * width, [run["after"][n]["exact_match"] for n in names], width, color=f"C{i}",
                  label=f"after DPO {tag}")
    left.set(xlabel="DPO step", ylim=(0, 1.05), title="held-out rewards/accuracies (on-policy pairs)")
    right.set(xticks=x + width * len(runs) / 2, xticklabels=names, ylim=(0, 1), ylabel="exact match",
              title="held-out greedy answers (200 prompts)")
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=4)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "dpo.png"), dpi=110)


if __name__ == "__main__":
    main()
