"""ALiBi against rotary positions past the training length: configs/gpt.py:tiny trained on 64-byte rows of the
Python standard library with each position choice for 150 steps, then evaluated on rows of 64, 256 and 512 bytes.

    python experiments/alibi_extrapolation.py /tmp/alibi_extrapolation            # trains, evaluates, writes
    python experiments/alibi_extrapolation.py /tmp/alibi_extrapolation --steps 40  # a laptop's minute

The committed alibi_extrapolation/ (results.md, metrics of each run) came from the first command with
experiments/alibi_extrapolation as the directory; results.md says what the numbers say. Press et al. (2022)
trained at 512 and 1024 tokens and found ALiBi's perplexity flat to several times that length while rotary's
rises; here the same question at toy scale: does the loss stay put when the rows grow past what training saw?
"""

import argparse
import json
import os
import subprocess
import sys

POSITIONS = ("rotary", "alibi")
LENGTHS = (64, 256, 512)


def command(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return out.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    rows = []
    for positions in POSITIONS:
        run = os.path.join(args.workdir, positions)
        command("transformer.train", f"--config=configs/gpt.py:tiny,model.positions={positions}", f"--workdir={run}",
                "--config.model.max_len=512", "--config.data.seq_len=64", "--config.data.batch_size=16",
                f"--config.train.steps={args.steps}", f"--config.train.eval_every={args.steps}",
                f"--config.train.checkpoint_every={args.steps}", "--config.train.sample_tokens=0")
        for length in LENGTHS:
            line = command("transformer.evaluate", f"--workdir={run}", f"--config.data.seq_len={length}",
                           "--config.data.batch_size=4")
            loss = float(line.split("eval/loss ")[1].split(",")[0])
            rows.append(dict(positions=positions, length=length, loss=loss))
            print(positions, length, loss, flush=True)
    with open(os.path.join(args.workdir, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    table = ["| positions | " + " | ".join(f"eval loss at L = {n}" for n in LENGTHS) + " |",
             "| --- |" + " --- |" * len(LENGTHS)]
    for positions in POSITIONS:
        losses = [r["loss"] for r in rows if r["positions"] == positions]
        table.append(f"| {positions} | " + " | ".join(f"{x:.3f}" for x in losses) + " |")
    with open(os.path.join(args.workdir, "results.md"), "w") as f:
        f.write(f"tiny GPT, {args.steps} steps at L = 64 (bytes of the Python standard library), nats per byte\n\n"
                + "\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
