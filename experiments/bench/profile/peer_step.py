"""Where the `--vs torch` peer's train step spends its time: `peer_process.Theirs` (the compiled nanoGPT-style
GPT, AdamW, the schedule) under `torch.profiler`, its operators' self times summed by part, per step.

    PYTHONPATH=. python experiments/bench/profile/peer_step.py CONFIG [--steps 3] [--ops 0]

CONFIG is a `--config` spec, as for `trace_step.py`, which gives the same parts of the project's step
(issue 21: the two side by side in experiments/bench/RESULTS.md). The process runs with the malloc
settings the bench gives the peer's process (`peer.child_tunables`: hostmem's without the single arena).
Self times add up to the traced steps' time; the profiler costs some (the untraced steps are printed
first). The parts: the matmuls inductor leaves to ATen (`mm`, `addmm`); the attention core (ATen's
fused CPU flash kernel, its products and softmax together); the loss over the logits; the optimizer
(fused AdamW, the clipping's norms and scaling, zeroing); the kernels inductor writes (every fused
elementwise pass: LayerNorm, GELU, residual adds, the autocast casts inside the graph), the self time of
its compiled graphs; copies and fills outside them.
"""

import argparse
import collections
import os
import re
import sys
import tempfile

import numpy as np

from transformer import hostmem

PARTS = (  # (part, a regex of the operator names it takes); the first match wins
    ("matmuls", r"aten::(mm|addmm|bmm|baddbmm)$"),
    ("attention core (flash kernel)", r"scaled_dot_product"),
    ("loss over the logits", r"log_softmax|nll_loss"),
    ("optimizer, clipping, zeroing", r"adamw|_foreach_|linalg_vector_norm|aten::mul_$|zero_grad|Optimizer"),
    ("inductor's fused kernels", r"CompiledFxGraph"),
    ("copies and fills", r"aten::(copy_|fill_|zero_|_to_copy)$"),
)


def part_of(op: str) -> str:
    return next((part for part, pattern in PARTS if re.search(pattern, op)), "other")


def with_peer_malloc() -> None:
    """Re-executes this script once with the peer process's GLIBC_TUNABLES (`peer.child_tunables` of
    hostmem's; glibc reads them when a process starts)."""
    if sys.platform.startswith("linux") and "GLIBC_TUNABLES" not in os.environ:
        from transformer.bench import peer
        os.environ["GLIBC_TUNABLES"] = ":".join(f"{k}={v}" for k, v in hostmem.TUNABLES.items())
        os.environ["GLIBC_TUNABLES"] = peer.child_tunables()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=3, help="steps profiled")
    parser.add_argument("--warmup", type=int, default=3, help="untraced steps after the compiling one")
    parser.add_argument("--ops", type=int, default=0, help="operators to list (most self time first)")
    args = parser.parse_args()
    with_peer_malloc()
    from torch.profiler import ProfilerActivity, profile

    from transformer import config as config_lib
    from transformer import models
    from transformer.bench import measure, peer, peer_process
    path, *overrides = args.config.split(",")
    config = config_lib.load(path, overrides)
    m, d = config.model, config.data
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, m.vocab_size, (d.batch_size, d.seq_len + 1))
               for _ in range(args.warmup + args.steps + 1)]
    with tempfile.TemporaryDirectory() as workdir:  # our initial weights, which the peer starts from
        weights = peer.initial_weights(measure.Ours.build(config, workdir).run.state.params, config)
    theirs = peer_process.Theirs(config, models.count_params(m), weights, batches[0], peer.schedule_values(config),
                                 "cpu", True, 0, "torch")
    print(theirs.describe())
    warm = [theirs.steps([batch]) for batch in batches[1:args.warmup + 1]]
    print(f"untraced steps: {', '.join(f'{1e3 * s:.0f}' for s in warm)} ms")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        theirs.steps(batches[args.warmup + 1:])
    ops = {e.key: e.self_cpu_time_total / 1e3 / args.steps for e in prof.key_averages()}  # ms per step
    parts = collections.Counter()
    for op, ms in ops.items():
        parts[part_of(op)] += ms
    total = sum(parts.values())
    print(f"\ntraced: {total:.1f} ms of operator self time per step ({args.steps} steps)\n\nms per step by part:")
    for part, ms in parts.most_common():
        print(f"  {ms:8.1f}  {100 * ms / total:5.1f}%  {part}")
    if args.ops:
        print("\noperators: ms per step, part")
        for op, ms in sorted(ops.items(), key=lambda kv: -kv[1])[:args.ops]:
            print(f"  {ms:8.1f}  {op[:70]}  ({part_of(op)})")


if __name__ == "__main__":
    main()
