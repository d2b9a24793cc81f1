"""From a base model to a chatbot: a tiny byte-level GPT pretrained on the stdlib, fine-tuned (task=sft) on a
generated instruction set (reverse a word, sort digits, count a letter, upper-case a word, a number in
binary; short inputs), scored by exact match on held-out prompts before and after (each
kind's first greedy answers kept); then the server's generated tokens per second with 1 and 8 concurrent
clients against the same requests sent one after another.

  python experiments/chat_sft/run.py --out /tmp/chat_exp [--pretrain_steps 800 --sft_steps 1000] [--no_throughput]
  python experiments/chat_sft/run.py --out runs/chat --data_only   # the conversations alone

Writes experiments/chat_sft/results.json and RESULTS.md's table (the commands it ran are in RESULTS.md).
"""

import argparse
import concurrent.futures
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
KINDS = ("reverse", "sort", "count", "upper", "binary")


def instruction(kind: str, rng: random.Random) -> tuple[str, str]:
    """(the user's instruction, the exact answer): short inputs, so every answer fits the context."""
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 5)))
    if kind == "reverse":
        return f"Reverse the word {word}.", word[::-1]
    if kind == "sort":
        numbers = [rng.randint(0, 9) for _ in range(rng.randint(3, 4))]
        return f"Sort these numbers: {' '.join(map(str, numbers))}", " ".join(map(str, sorted(numbers)))
    if kind == "count":
        letter = rng.choice(sorted(set(word)))
        return f"How many times does {letter} appear in {word}?", str(word.count(letter))
    if kind == "upper":
        return f"Convert {word} to upper case.", word.upper()
    n = rng.randint(1, 255)
    return f"Convert {n} to binary.", format(n, "b")


def write_sets(out: str, train: int, held: int) -> tuple[str, str]:
    rng = random.Random(0)
    seen, rows = set(), {"train": [], "held": []}
    while len(rows["train"]) < train or len(rows["held"]) < held:
        kind = rng.choice(KINDS)
        prompt, answer = instruction(kind, rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        split = "held" if len(rows["held"]) < held and rng.random() < 0.1 else "train"
        if len(rows[split]) >= (held if split == "held" else train):
            continue
        system = [{"role": "system", "content": "Answer with the result only."}] if rng.random() < 0.5 else []
        rows[split].append({"messages": [*system, {"role": "user", "content": prompt},
                                         {"role": "assistant", "content": answer}], "kind": kind})
    paths = []
    for split, items in rows.items():
        path = os.path.join(out, f"{split}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in items)
        paths.append(path)
    with open(os.path.join(HERE, "tasks", "held_prompts.jsonl"), "w") as f:  # the harness task's data
        f.writelines(json.dumps({"prompt": r["messages"][-2]["content"], "answer": r["messages"][-1]["content"],
                                 "kind": r["kind"]}) + "\n" for r in rows["held"])
    return paths


def train(args: list[str]) -> None:
    command = [sys.executable, "-m", "transformer.train", *args]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})


def exact_match(held: str, answer, shown: int = 3) -> dict:
    """{kind: share answered exactly, 'all': ..., 'answers': {kind: [[prompt, expected, greedy answer]] (the
    first `shown`)}} of the held-out conversations."""
    right, answers = {k: [] for k in KINDS}, {k: [] for k in KINDS}
    for line in open(held):
        row = json.loads(line)
        got, expected = answer(row["messages"][:-1]).strip(), row["messages"][-1]["content"]
        right[row["kind"]].append(got == expected)
        if len(answers[row["kind"]]) < shown:
            answers[row["kind"]].append([row["messages"][-2]["content"], expected, got])
    scores = {k: float(np.mean(v)) for k, v in right.items()}
    return scores | {"all": float(np.mean([x for v in right.values() for x in v])), "answers": answers}


def scores(pre: str, sft_dir: str, held: str) -> dict:
    from transformer import rundir
    from transformer.inference import engine, sampling
    from transformer.training.tasks import sft

    base = rundir.open(pre)
    model, params, tokenizer = base.model(), base.restore_params(), base.tokenizer()

    def base_answer(messages):  # the base model, prompted as plain text: the instruction, then the answer's line
        text = "".join(f"{m['content']}\n" for m in messages)
        return engine.complete(model, params, tokenizer, text, sampling.Sampling(max_new_tokens=16))[0].split("\n")[0]

    run = rundir.open(sft_dir)
    tuned, tuned_params, chat = run.model(), run.restore_params(), run.chat_format()
    return {"before": exact_match(held, base_answer),
            "after": exact_match(held, lambda m: sft.reply(tuned, tuned_params, chat, m, 16))}


def figure(exact: dict, path: str) -> None:
    """Bars of each kind's held-out exact match before and after fine-tuning."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*KINDS, "all"]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for shift, (label, key) in zip((-0.2, 0.2), (("before (base, plain text)", "before"),
                                                 ("after SFT (chat template)", "after"))):
        ax.bar(x + shift, [exact[key][n] for n in names], 0.4, label=label)
    ax.set(xticks=x, xticklabels=names, ylabel="exact match", ylim=(0, 1),
           title="Held-out instructions, greedy answers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def throughput(sft_dir: str, held: str, requests: int = 32) -> dict:
    """Generated tokens per second through the server: sequential, 1 client, 8 concurrent clients."""
    import httpx
    import uvicorn

    from transformer.inference import engine, server

    runner = engine.Engine.open(sft_dir, max_batch=8).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    instance = uvicorn.Server(uvicorn.Config(server.make_app(runner, "chat-sft"), port=port, log_level="warning"))
    threading.Thread(target=instance.run, daemon=True).start()
    while not instance.started:
        time.sleep(0.05)
    prompts = [json.loads(line)["messages"][:-1] for line in open(held)][:requests]
    body = lambda m: {"messages": m, "temperature": 0, "max_tokens": 16}
    out = {}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=600) as http:
        def ask(m):
            return http.post("/chat/completions", json=body(m)).json()["usage"]["completion_tokens"]
        for m in prompts[:8]:  # compile every shape once
            ask(m)
        concurrent.futures.ThreadPoolExecutor(8).map(ask, prompts[:8])
        for name, clients in (("sequential", 0), ("1 client", 1), ("8 clients", 8)):
            start, batches = time.perf_counter(), runner.batches
            if clients == 0:
                tokens = sum(ask(m) for m in prompts)
            else:
                with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                    tokens = sum(pool.map(ask, prompts))
            seconds = time.perf_counter() - start
            out[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                         "batches": runner.batches - batches}
    instance.should_exit = True
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/chat_exp")
    parser.add_argument("--pretrain_steps", type=int, default=800)
    parser.add_argument("--sft_steps", type=int, default=1000)
    parser.add_argument("--train", type=int, default=8000)
    parser.add_argument("--held", type=int, default=200)
    parser.add_argument("--data_only", action="store_true", help="write train.jsonl and held.jsonl, and stop")
    parser.add_argument("--no_throughput", action="store_true", help="keep results.json's server timings")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pre, tuned = os.path.join(args.out, "pre"), os.path.join(args.out, "sft")
    train_path, held_path = write_sets(args.out, args.train, args.held)
    if args.data_only:
        return
    if not os.path.isdir(os.path.join(pre, "checkpoints", str(args.pretrain_steps))):
        train(["--config", "configs/gpt.py:tiny", "--workdir", pre, f"--config.train.steps={args.pretrain_steps}",
               f"--config.train.eval_every={args.pretrain_steps}", "--config.train.sample_tokens=0",
               f"--config.train.checkpoint_every={args.pretrain_steps}", "--config.train.log_every=50"])
    if not os.path.isdir(os.path.join(tuned, "checkpoints", str(args.sft_steps))):
        train(["--config", f"configs/sft.py:init_from={pre},data.train_path={train_path},"
               f"data.eval_path={held_path}", "--workdir", tuned, f"--config.train.steps={args.sft_steps}",
               f"--config.train.eval_every={args.sft_steps // 2}", "--config.train.sample_tokens=16",
               f"--config.train.checkpoint_every={args.sft_steps}", "--config.data.seq_len=128"])
    sys.path.insert(0, REPO)
    path = os.path.join(HERE, "results.json")
    results = json.load(open(path)) if args.no_throughput and os.path.isfile(path) else {}
    results |= {"exact_match": scores(pre, tuned, held_path), "pretrain_steps": args.pretrain_steps,
                "sft_steps": args.sft_steps, "train": args.train, "held": args.held}
    if not args.no_throughput:
        results["throughput"] = throughput(tuned, held_path)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    figure(results["exact_match"], os.path.join(HERE, "exact_match.png"))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
