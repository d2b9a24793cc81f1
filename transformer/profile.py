"""Print a run's profile as device time per kernel per step.

The loop traces a window of steps (transformer/training/profiler.py); this reads it back.

  python -m transformer.train ... --config.train.profile_start=20 --config.train.profile_steps=5
  python -m transformer.profile runs/small [--top 30] [--skip 1]
"""

from absl import flags

from transformer import cli
from transformer.training import profiler

FLAGS = flags.FLAGS


def main(argv) -> None:
    for line in profiler.report(profiler.latest_trace(argv[1]), FLAGS.top, FLAGS.skip):
        print(line)


if __name__ == "__main__":
    flags.DEFINE_integer("top", 30, "kernels listed (the rest summed)")
    flags.DEFINE_integer("skip", 1, "traced steps left out of the means (the first may still autotune)")
    cli.run(main, positional=1)
