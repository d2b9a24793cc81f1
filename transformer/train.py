"""Train a model from a config file.

  python -m transformer.train --config configs/gpt.py:tiny --workdir runs/gpt-tiny \
      [--config.optim.lr=1e-3 ...]

Running the same command on an existing workdir resumes from its latest checkpoint.
Ctrl-C (or SIGTERM) saves a checkpoint and exits.
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from transformer import config as config_lib
from transformer.training import loop

config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/gpt.py:tiny.", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: config, metrics, checkpoints.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        loop.train(flags.FLAGS.config, flags.FLAGS.workdir)
    except (ValueError, FileNotFoundError, KeyError, loop.NonFiniteLoss) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main, flags_parser=config_lib.parse_flags)
