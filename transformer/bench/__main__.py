"""Benchmark a config's model on this device: training throughput and generation latency.

Optionally against the same model in PyTorch (the peer).

  python -m transformer.bench --config configs/gpt.py:tiny [--steps 10] [--mode train|generate|data|all]
  python -m transformer.bench --config configs/gpt.py:gpt2-small,data.batch_size=4,data.seq_len=128 \
      --vs hf --rounds 5 --steps 3

What each mode measures: measure.py. `--vs hf` compares with transformers' GPT2LMHeadModel, `--vs torch`
with a nanoGPT-style GPT (torch_gpt.py), each in a process of its own (peer.py), in interleaved rounds.
The GPU suite that runs many of these in turn is experiments/bench/gpu_suite.py.
"""

import json
import os
import time
import types

import jax
from absl import flags

from transformer import cli
from transformer.bench import measure, peer
from transformer.training import checks, shapes


def define_flags() -> None:
    cli.define_config()
    flags.DEFINE_integer("steps", 10, "Timed training steps per round.")
    flags.DEFINE_integer("warmup", 2, "Untimed training steps after compiling.")
    flags.DEFINE_integer("rounds", 1, "Rounds of timed steps (interleaved with the peer's under --vs).")
    flags.DEFINE_enum("mode", "train", ["train", "generate", "data", "all"], "What to time.")
    flags.DEFINE_enum("vs", "", ["", "hf", "torch"], "Peer to compare with: 'hf' (transformers' GPT2LMHeadModel) "
                      "or 'torch' (a nanoGPT-style GPT in PyTorch, transformer/bench/torch_gpt.py).")
    flags.DEFINE_integer("prompt_len", 0, "Generation prompt length (default: half of seq_len).")
    flags.DEFINE_integer("new_tokens", 64, "Generated tokens (capped by max_len - prompt_len).")
    flags.DEFINE_list("gen_batches", ["1", "8"], "Generation batch sizes.")
    flags.DEFINE_integer("gen_rounds", 3, "Interleaved generation rounds.")
    flags.DEFINE_bool("hf_eager", False, "Time the peer (hf or torch) without torch.compile.")
    flags.DEFINE_integer("hf_threads", 0, "The peer's (hf or torch) torch threads (default: the core count; "
                         "XLA:CPU's intra-op pool takes the cores available to the process).")
    flags.DEFINE_string("json", "", "Also write the results, by mode, to this JSON file.")


def main(argv):
    f = flags.FLAGS
    if f.vs:  # on a GPU the peer trains on it too: JAX takes what it uses, not 75% of its memory up front
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    config = shapes.resolved(f.config, say=print)
    checks.validate(config)
    jax.config.update("jax_enable_compilation_cache", False)
    if f.vs:
        peer.check(f.vs, config)  # refuses a model the peer cannot be, before any work
    args = types.SimpleNamespace(**{name: getattr(f, name) for name in measure.ARGS},
                                 gen_batches=[int(b) for b in f.gen_batches])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = f"| XLA:CPU pool {cores} cores " if jax.default_backend() == "cpu" else ""
    if f.vs:
        import torch
        threads += f"| torch {torch.__version__}, {f.hf_threads or os.cpu_count() or 1} threads "
    print(f"transformer.bench {' '.join(argv[1:]) or ''}| jax {jax.__version__} {threads}| {time.strftime('%Y-%m-%d')}")
    results = {}
    if f.mode in ("train", "all"):
        results["train"] = measure.bench_train(config, args, f.vs)
    if f.mode == "data":
        results["data"] = measure.bench_data(config, args)
    if f.mode in ("generate", "all"):
        results["generate"] = measure.bench_generate(config, args, f.vs)
    if f.json:
        with open(f.json, "w") as out:
            json.dump(results, out, default=str)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
