"""Train a model from a config file.

  python -m transformer.train --config configs/gpt.py:tiny --workdir runs/gpt-tiny \
      [--config.optim.lr=1e-3 ...]

Running the same command on an existing workdir resumes from its latest checkpoint.
Ctrl-C (or SIGTERM) saves a checkpoint and exits.

Multi-host: run the same command on every host with --coordinator=HOST0:PORT
--num_processes=N --process_id=I (I = 0..N-1); under srun (SLURM) or on a Cloud TPU slice
that sets TPU_WORKER_HOSTNAMES leave them out (detected); --distributed leaves the
detection to jax.distributed (e.g. a gcloud TPU VM slice, through its metadata server).
Every process loads its share of each batch and writes its part of the checkpoints into
the shared workdir; process 0 alone writes the config, tokenizer and metrics, and prints.
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from transformer import config as config_lib, parallel
from transformer.training import loop

config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/gpt.py:tiny.", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: config, metrics, checkpoints.")
flags.mark_flags_as_required(["config", "workdir"])
parallel.define_flags()


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    f = flags.FLAGS
    try:
        parallel.initialize(f.coordinator, f.num_processes, f.process_id, f.distributed)
        loop.train(f.config, f.workdir)
    except (ValueError, FileNotFoundError, KeyError, loop.NonFiniteLoss) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main, flags_parser=config_lib.parse_flags)
