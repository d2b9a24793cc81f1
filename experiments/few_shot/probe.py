"""The view inside the model of run.py's GPT: its in-context learning score and its heads' induction scores
at every checkpoint (`transformer.probe.incontext`).

  PYTHONPATH=. python experiments/few_shot/probe.py [--workdir runs/few_shot/gpt]

The score is read on 16 fresh keymap documents (run.py's kind, a seed the corpus did not use), cut to the
model's context of 64 bytes: the loss on tokens 48 to 59 minus the loss on tokens 3 to 14 (whole lines of
3 bytes each, so both windows hold as many keys as values). Writes incontext.png and incontext.json here.
"""

import argparse
import json
import os

import numpy as np

from transformer.probe import incontext

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    import run as few_shot

    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default=os.path.join(few_shot.REPO, "runs", "few_shot", "gpt"))
    args = parser.parse_args()
    rng = np.random.default_rng(12345)
    texts = [few_shot.document(rng) for _ in range(16)]
    tokens = np.stack([np.frombuffer(t.encode(), np.uint8)[:64] for t in texts]).astype(np.int32)  # [B, 64]
    history = incontext.over_checkpoints(args.workdir, tokens, early=(3, 15), late=(48, 60))
    with open(os.path.join(HERE, "incontext.json"), "w") as f:
        json.dump(history, f)
    incontext.figure(history, os.path.join(HERE, "incontext.png"),
                     "keymap GPT: in-context learning and induction heads over training")
    for h in history:
        best = max((max(v), k) for k, v in h["induction"].items())
        print(f"step {h['step']}: icl score {h['icl_score']:+.3f} nats, best induction head {best[0]:.2f} ({best[1]})")


if __name__ == "__main__":
    main()
