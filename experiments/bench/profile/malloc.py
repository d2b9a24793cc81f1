"""A train step's time, minor page faults and system time under the glibc malloc tunables it was started with.

  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 PYTHONPATH=. python experiments/bench/profile/malloc.py "$S1"
  GLIBC_TUNABLES=... PYTHONPATH=. python experiments/bench/profile/malloc.py "$S1" --side peer

Times ours (`measure.Ours`: the step `transformer.train` runs) or the `--vs torch` peer (`peer_process.Theirs`, in
this process) for --steps steps after two untimed ones, and reads getrusage around them. The tunables
are the ones this process was started with: unlike the commands, it does not call hostmem.tune_malloc,
so that each setting can be compared (experiments/bench/RESULTS.md, issue 21's third session).
"""

import argparse
import os
import resource
import statistics
import tempfile

import numpy as np

from transformer import config as config_lib
from transformer import models
from transformer.bench import measure, peer, peer_process


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--side", choices=["ours", "peer"], default="ours")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    config = config_lib.load(args.config)
    with tempfile.TemporaryDirectory() as workdir:
        ours = measure.Ours.build(config, workdir)
        if args.side == "ours":
            step = lambda: ours.steps(1)
        else:
            batches = (np.asarray(ours.run.task.train_batch(s)["tokens"]) for s in range(args.steps + 3))
            weights = peer.initial_weights(ours.run.state.params, config)
            theirs = peer_process.Theirs(config, models.count_params(config.model), weights, next(batches),
                                         peer.schedule_values(config), threads=2, kind="torch")
            step = lambda: theirs.steps([next(batches)])
        step(), step()
        before = resource.getrusage(resource.RUSAGE_SELF)
        times = [step() for _ in range(args.steps)]
        after = resource.getrusage(resource.RUSAGE_SELF)
    n = args.steps
    print(f"{args.side} | GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES')} | "
          f"step {1e3 * statistics.median(times):.1f} ms (median of {n}: {', '.join(f'{1e3 * t:.0f}' for t in times)}) "
          f"| minor faults / step {(after.ru_minflt - before.ru_minflt) / n:,.0f} "
          f"| system time / step {(after.ru_stime - before.ru_stime) / n:.3f} s")


if __name__ == "__main__":
    main()
