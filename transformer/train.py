"""Train a model from a config file, or resume a run from its workdir.

  python -m transformer.train --config configs/gpt.py:tiny --workdir runs/gpt-tiny \\
      [--config.train.steps=200 --config.optim.lr=1e-3 ...]
  python -m transformer.train --workdir runs/gpt-tiny [--config.train.steps=3000]

Each key of the config is set with --config.KEY=VALUE; list them, with their values, defaults and
meanings, with `python -m transformer.inspect --config configs/gpt.py:tiny --keys` (or
`--workdir DIR --keys`). Running the same command on an existing workdir resumes from its latest
checkpoint; without --config it resumes from the workdir's own config.json, the overrides applied
(a longer train.steps extends the run; a model key other than how it computes fails).
--resume_step S resumes from the kept checkpoint S instead (the later ones set aside): a run that diverged
names its kept checkpoints, their losses and the step where its loss spiked, and advises one before it.
Ctrl-C (or SIGTERM) saves a checkpoint and exits. A mistake in the config fails in one line
naming the key, with exit code 2, before any data is read or anything compiles.

Multi-host: run the same command on every host with --coordinator=HOST0:PORT
--num_processes=N --process_id=I (I = 0..N-1); under srun (SLURM) or on a Cloud TPU slice
that sets TPU_WORKER_HOSTNAMES leave them out (detected); --distributed leaves the
detection to jax.distributed (e.g. a gcloud TPU VM slice, through its metadata server).
Every process loads its share of each batch and writes its part of the checkpoints into
the shared workdir; process 0 alone writes the config, tokenizer and metrics, and prints.
"""

import os
import sys

from absl import flags

from transformer import cli, parallel, rundir
from transformer.training import checks, divergence, loop


def main(argv):
    f = flags.FLAGS
    launch = checks.checked(f.config, workdir=f.workdir)
    parallel.initialize(f.coordinator, f.num_processes, f.process_id, f.distributed)
    done = (rundir.RunDir(f.workdir).latest_step
            if os.path.isdir(os.path.join(f.workdir, rundir.CHECKPOINTS)) else None)
    if done is not None and done >= f.config.train.steps and f.resume_step is None:
        print(f"{f.workdir}: the run is complete at step {done} (config.train.steps={f.config.train.steps}); "
              f"--config.train.steps={2 * done} trains it on to step {2 * done}")
        return
    try:
        loop.train(launch, f.workdir, resume_step=f.resume_step)
    except divergence.NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli.define_config(cli.CONFIG_HELP + ". Left out: the --workdir's own (resuming it).", required=False)
    flags.DEFINE_string("workdir", None, "Run directory: config, metrics, checkpoints.")
    flags.mark_flag_as_required("workdir")
    flags.DEFINE_integer("resume_step", None, "Resume from this kept checkpoint (one before a divergence began), "
                         "the later ones moved to checkpoints.skipped/. Default: the latest.")
    parallel.define_flags()
    cli.run(main, resume=rundir.resumed_config)
