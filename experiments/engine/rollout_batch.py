"""Seconds of one GRPO rollout batch in experiments/grpo's setting (16 prompts x 8 completions of up to 4
tokens, 24-33 prompt tokens) on configs/gpt.py:tiny's shape (random weights), with the old log-probs GRPO needs.

  PYTHONPATH=. python experiments/engine/rollout_batch.py --rounds 3          # this tree (the engine)
  PYTHONPATH=/path/to/main python experiments/engine/rollout_batch.py        # the tree before it

Where the sampler hands back the policy's own log-probs (`Rollouts.policy`) they are the old ones; otherwise
a second forward computes them, as GRPO did. The same prompts every round (warm: nothing compiles in the
timed rounds), so the old path's program per prompt length is not counted. Prints one JSON line.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from transformer.inference import rollouts
from transformer.models import gpt
from transformer.training import grpo_loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args()
    cfg = gpt.default_model_config("tiny")
    cfg.update(vocab_size=264, max_len=128)
    model = gpt.build(cfg)
    params = jax.tree.map(lambda x: getattr(x, "value", x), model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))[
        "params"], is_leaf=lambda x: hasattr(x, "value"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, n).tolist() for n in rng.integers(24, 34, 16)]
    logp = jax.jit(lambda p, s, st: grpo_loss.token_logprobs(model, p, s, st, 4))

    def batch(step):
        drawn = rollouts.sample(model, params, prompts, 8, rollouts.rollout_key(0, step), max_new_tokens=4, stop_id=0)
        if not getattr(drawn, "policy", False):
            seqs, starts = grpo_loss.sequences(drawn)
            np.asarray(logp(params, seqs, starts))

    batch(0)
    times = []
    for step in range(1, a.rounds + 1):
        start = time.perf_counter()
        batch(step)
        times.append(time.perf_counter() - start)
    print(json.dumps({"best_s": min(times), "times": times}))


if __name__ == "__main__":
    main()
