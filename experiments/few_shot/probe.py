"""The view inside the model of run.py's GPT: its in-context learning score, its heads' induction scores and
its loss on repeated strings at every checkpoint (`transformer.probe.incontext`).

  PYTHONPATH=. python experiments/few_shot/probe.py [--workdir runs/few_shot/gpt]

The score is read on 16 fresh keymap documents (run.py's kind, a seed the corpus did not use), cut to the
model's context of 64 bytes: the loss on tokens 48 to 59 minus the loss on tokens 3 to 14 (whole lines of
3 bytes each, so both windows hold as many keys as values); the induction scores on 32 distinct bytes of
run.ALPHABET repeated once. The diagnosis of copying: the loss on 16 fresh `repeats` strings, on the bytes of
the first copy (only guessable) and on those after it (copyable). Writes incontext.png and incontext.json here.
"""

import argparse
import json
import os

import numpy as np

from transformer import probe
from transformer.probe import incontext

HERE = os.path.dirname(os.path.abspath(__file__))


def repeat_losses(workdir: str, step: int, rng) -> tuple[float, float]:
    """(mean loss on the first copy's bytes, on the bytes after it) of 16 fresh `repeats` strings."""
    import run as few_shot

    texts, firsts = [], []
    for _ in range(16):
        text = few_shot.repeats(rng)
        texts.append(np.frombuffer(text.encode(), np.uint8)[:64].astype(np.int32))
        firsts.append(text.index(text[:8], 1))  # the first copy's length
    run = probe.load(workdir, step)
    losses = incontext.token_losses(run.model, run.params, np.stack(texts))  # [16, 63]: byte t + 1's
    first = np.concatenate([row[:n - 1] for row, n in zip(losses, firsts)])
    later = np.concatenate([row[n - 1:] for row, n in zip(losses, firsts)])
    return float(first.mean()), float(later.mean())


def main():
    import run as few_shot

    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default=os.path.join(few_shot.REPO, "runs", "few_shot", "gpt"))
    args = parser.parse_args()
    rng = np.random.default_rng(12345)
    texts = [few_shot.document(rng) for _ in range(16)]
    tokens = np.stack([np.frombuffer(t.encode(), np.uint8)[:64] for t in texts]).astype(np.int32)  # [B, 64]
    alphabet = np.frombuffer(few_shot.ALPHABET.encode(), np.uint8).astype(np.int32)
    history = incontext.over_checkpoints(args.workdir, tokens, early=(3, 15), late=(48, 60), alphabet=alphabet)
    for h in history:
        h["repeat_loss_first"], h["repeat_loss_after"] = repeat_losses(args.workdir, h["step"], rng)
    with open(os.path.join(HERE, "incontext.json"), "w") as f:
        json.dump(history, f)
    incontext.figure(history, os.path.join(HERE, "incontext.png"),
                     "keymap GPT: in-context learning and induction heads over training")
    for h in history:
        best = max((max(v), k) for k, v in h["induction"].items())
        print(f"step {h['step']}: icl score {h['icl_score']:+.3f} nats, best induction head {best[0]:.2f} "
              f"({best[1]}), repeats' loss {h['repeat_loss_first']:.2f} on the first copy, "
              f"{h['repeat_loss_after']:.2f} after", flush=True)


if __name__ == "__main__":
    main()
