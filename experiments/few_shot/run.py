"""Few-shot learning, measured: a small GPT trained here learns to learn from its prompt.

  PYTHONPATH=. HF_DATASETS_OFFLINE=1 python experiments/few_shot/run.py [--steps 4000] [--lr 1e-2]
      [--repeated 0.5] [--out runs/few_shot]

The corpus (written here, never committed): documents of lines `KEYVALUE` (`c5`), each document one fresh
random mapping of 8 letters onto 8 digits, its keys repeated. Nothing fixes a mapping, so the only way to
predict a value is to find the key earlier in the document: the in-context learning the notes credit GPT-3
with, in miniature (an induction head's job). A `--repeated` share of the documents are random strings of
letters and digits written 4 times, a denser signal for the same mechanism. The shipped tasks
(experiments/few_shot/tasks, local harness tasks: `keymap_mc`, multiple choice over the 8 digits after `c`,
and `keymap_gen`, the digit generated until a newline) hold one mapping of their own, never seen in
training: with 0 shots a model can only guess (1/8), with k shots it can copy the value of the key where a
shot showed it (a shot shows the query's key with probability 1 - (7/8)^k).

The GPT (byte-level, 2 layers, width 96, 8 heads, rotary positions, a context of 64 bytes, lr 1e-2 constant)
is scored at 0, 1, 2, 4 and 8 shots at several checkpoints, and a random tiny GPT-2 made by transformers and
converted is scored on the same tasks (needs torch). Writes results.json and shots.png here and prints
RESULTS.md's table; `probe.py` draws the view inside the model.
"""

import argparse
import json
import os
import string
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TASKS = os.path.join(HERE, "tasks")
KEYS, VALUES = "abcdefgh", "01234567"
ALPHABET = string.ascii_letters + string.digits
SHOTS = (0, 1, 2, 4, 8)
NAMES = ["keymap_mc", "keymap_gen"]


def document(rng) -> str:
    """One random mapping of KEYS onto VALUES, shown as 40 lines `kv` in a random order of keys."""
    mapping = dict(zip(KEYS, rng.permutation(list(VALUES))))
    return "".join(f"{k}{mapping[k]}\n" for k in rng.choice(list(KEYS), 40))


def repeats(rng) -> str:
    """A random string of 16 to 28 bytes of ALPHABET and a newline, written 4 times: every byte after the first
    copy is predictable only by finding the current byte earlier in the context and copying what followed it
    (an induction head's job; the copy's distance varies, so no fixed-offset head can do it)."""
    line = "".join(rng.choice(list(ALPHABET), rng.integers(16, 29))) + "\n"
    return line * 4


def write_corpus(path: str, documents: int, repeated: float, seed: int = 0) -> None:
    """`documents` keymap documents, a `repeated` share of them replaced by `repeats` strings."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(documents):
            text = repeats(rng) if rng.random() < repeated else document(rng)
            f.write(json.dumps({"text": text}) + "\n")


def train(workdir: str, corpus: str, steps: int, lr: float, heads: int) -> None:
    overrides = ["model.num_layers=2", "model.d_model=96", f"model.num_heads={heads}", "model.mlp_dim=384",
                 "model.positions=rotary", "model.max_len=64", "data.seq_len=64", "data.batch_size=32",
                 f"data.source={corpus}", "data.eval_batches=2", f"optim.lr={lr}", "optim.warmup_steps=50",
                 "optim.schedule=constant", f"train.steps={steps}",
                 f"train.checkpoint_every={steps // 6}", f"train.eval_every={steps // 6}",
                 "train.keep_checkpoints=10", "train.sample_tokens=0", "train.log_every=50"]
    subprocess.run([sys.executable, "-m", "transformer.train", "--config", f"{REPO}/configs/gpt.py:tiny",
                    "--workdir", workdir, *[f"--config.{o}" for o in overrides]], check=True, cwd=REPO)


def score(workdir: str, steps: list[int] | None = None) -> dict:
    """{step: {task: {shots: accuracy}}} of the run's checkpoints (all, or `steps`)."""
    from transformer import rundir
    from transformer.inference import harness, scoring
    from transformer.training import harness_tasks

    manager = harness.task_manager(TASKS)
    table = {}
    for step in steps or rundir.open(workdir).steps:
        scorer = scoring.Scorer.from_run(workdir, step, batch_size=32)
        for shots in SHOTS:
            results = harness_tasks.run_tasks(scorer, NAMES, manager, num_fewshot=shots)
            metrics = harness_tasks.metrics_of(results)
            for name, metric in (("keymap_mc", "acc"), ("keymap_gen", "exact_match_digit")):
                table.setdefault(step, {}).setdefault(name, {})[shots] = metrics[f"eval/harness/{name}/{metric}"]
            print(f"step {step} shots {shots}: {table[step]['keymap_mc'][shots]:.3f} "
                  f"{table[step]['keymap_gen'][shots]:.3f}  ({scorer.programs} programs)", flush=True)
    return table


def imported_gpt2(out: str) -> str:
    """A random tiny GPT-2 (transformers) with a byte-level BPE trained on the tasks' own lines, converted."""
    import torch
    import transformers

    from transformer.data.text import tokenizers
    from transformer.interop import hf_import

    rng = np.random.default_rng(1)
    bpe = tokenizers.train_bpe([document(rng) for _ in range(200)], 300).tokenizer
    bpe.add_special_tokens(["<|endoftext|>"])
    tok = transformers.GPT2TokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>",
                                         eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=len(tok), n_positions=256,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained(os.path.join(out, "gpt2-hf"))
    tok.save_pretrained(os.path.join(out, "gpt2-hf"))
    workdir = os.path.join(out, "gpt2-converted")
    if not os.path.isdir(workdir):
        hf_import.convert(os.path.join(out, "gpt2-hf"), workdir)
    return workdir


def figure(table: dict, imported: dict | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, name in zip(axes, NAMES):
        for step, row in sorted(table.items()):
            ax.plot(SHOTS, [row[name][k] for k in SHOTS], marker="o", label=f"GPT step {step}")
        if imported:
            ax.plot(SHOTS, [imported[name][k] for k in SHOTS], "k--", marker="x", label="random GPT-2 (converted)")
        ax.axhline(1 / len(VALUES), color="grey", lw=0.8, ls=":", label="chance (1/8)")
        ax.set(title=name, xlabel="shots in the prompt", xscale="symlog", xticks=SHOTS, xticklabels=SHOTS)
    axes[0].set_ylabel("accuracy")
    axes[1].legend(fontsize=8)
    fig.suptitle("Few-shot learning of a new key -> digit mapping, over training")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(table: dict, imported: dict | None) -> str:
    lines = ["| model | task | " + " | ".join(f"{k} shots" for k in SHOTS) + " |",
             "|---|---|" + "---:|" * len(SHOTS)]
    rows = [(f"GPT step {step}", row) for step, row in sorted(table.items())]
    rows += [("random GPT-2, converted", imported)] if imported else []
    for label, row in rows:
        for name in NAMES:
            lines.append(f"| {label} | {name} | " + " | ".join(f"{row[name][k]:.3f}" for k in SHOTS) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "few_shot"))
    parser.add_argument("--documents", type=int, default=20000)
    parser.add_argument("--repeated", type=float, default=0.5, help="share of the documents that are `repeats`")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--train_only", action="store_true", help="train, and score nothing (pilots)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    corpus, workdir = os.path.join(args.out, "keymaps.jsonl"), os.path.join(args.out, "gpt")
    if not os.path.exists(corpus):
        write_corpus(corpus, args.documents, args.repeated)
    train(workdir, corpus, args.steps, args.lr, args.heads)
    if args.train_only:
        return
    table = score(workdir)
    try:
        imported = score(imported_gpt2(args.out))[0]
    except ImportError as e:
        print(f"no imported model: {e}")
        imported = None
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump({"gpt": table, "imported_gpt2": imported}, f, indent=1)
    figure(table, imported, os.path.join(HERE, "shots.png"))
    print(markdown(table, imported))


if __name__ == "__main__":
    main()
