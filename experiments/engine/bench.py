"""Decode tokens/s of the engine against transformers' `generate`, and serve-like concurrency.

  PYTHONPATH=. python experiments/engine/bench.py --layers 12 --new 16 --rounds 2   # GPT-2-small's shape
  PYTHONPATH=. python experiments/engine/bench.py --layers 2 --new 8 --rounds 1     # a laptop minute

A GPT-2-small-shaped model (random weights, vocab 50257) decodes `--new` greedy tokens after a 16-token prompt
at batch 1, 8 and 32, ours (the engine) and transformers' GPT2LMHeadModel.generate (PyTorch, the same
threads), interleaved round by round; the best round is kept. MBU is the bytes a decode step reads (params
and the cache) per second over `--peak_gbs`. Then 32 requests of 32 prompt lengths through one engine at
once, against the same requests one after another. Prints a markdown table.
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from transformer.inference import engine, sampling
from transformer.models import gpt

VOCAB, PROMPT = 50257, 16


def ours(layers: int):
    cfg = gpt.default_model_config("gpt2-small")
    cfg.update(num_layers=layers, vocab_size=VOCAB, max_len=256)
    model = gpt.build(cfg)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    return model, jax.tree.map(lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value"))


def theirs(layers: int):
    import torch
    import transformers

    torch.set_num_threads(int(os.environ.get("THREADS", os.cpu_count() or 1)))
    config = transformers.GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=VOCAB, n_positions=256)
    return transformers.GPT2LMHeadModel(config).eval(), torch


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--peak_gbs", type=float, default=20.0, help="the machine's memory bandwidth, GB/s")
    a = parser.parse_args()
    model, params = ours(a.layers)
    hf, torch = theirs(a.layers)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    print(f"layers {a.layers}, {a.new} new tokens, best of {a.rounds} rounds, jax {jax.__version__}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} torch threads")
    print("| what | ours | theirs | ratio | |\n|---|---|---|---|---|", flush=True)
    for batch in (1, 8, 32):
        prompts = rng.integers(0, VOCAB, (batch, PROMPT)).tolist()
        settings = sampling.Sampling(max_new_tokens=a.new)
        runner = engine.Engine(model, params, slots=batch, context=64, steps=8)
        go = lambda runner=runner, prompts=prompts, settings=settings: runner.run(  # noqa: E731
            [engine.Request(p, settings) for p in prompts])
        ids = torch.tensor(prompts)
        hf_go = lambda ids=ids: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new,  # noqa: E731
                                            min_new_tokens=a.new, do_sample=False, pad_token_id=0)
        go(), hf_go()  # compiled, warmed
        mine, yours = [], []
        for _ in range(a.rounds):
            mine.append(timed(go))
            with torch.no_grad():
                yours.append(timed(hf_go))
        tok_mine, tok_yours = batch * a.new / min(mine), batch * a.new / min(yours)
        cache_bytes = 2 * a.layers * batch * 64 * 768 * 4
        mbu = (weight_bytes + cache_bytes) * tok_mine / batch / 1e9 / a.peak_gbs
        print(f"| decode, batch {batch} | {tok_mine:,.1f} tok/s | {tok_yours:,.1f} tok/s | "
              f"{tok_mine / tok_yours:.2f}x | MBU {100 * mbu:.1f}% |", flush=True)
    lengths = list(range(4, 36))
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in lengths]
    settings = sampling.Sampling(max_new_tokens=a.new)
    runner = engine.Engine(model, params, slots=32, context=64, steps=8).warm()
    together = timed(lambda: runner.run([engine.Request(p, settings) for p in prompts]))
    one_by_one = timed(lambda: [runner.run([engine.Request(p, settings)]) for p in prompts])
    print(f"| 32 requests of 32 lengths | {together:.2f} s at once | {one_by_one:.2f} s one at a time | "
          f"{one_by_one / together:.2f}x | |", flush=True)


if __name__ == "__main__":
    main()
