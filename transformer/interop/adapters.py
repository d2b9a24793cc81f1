"""A run's LoRA adapters folded into its base for good: a new run directory of the merged weights.

  python -m transformer.convert --workdir runs/gpt-tiny-lora --merge_to runs/gpt-tiny-merged [--step N]

The new run holds the merged weights at step 0 (no optimizer state, as a converted run), the config with
config.lora.rank=0, and every other file of the run's top level (tokenizer, labels, chat template); it
generates, evaluates and fine-tunes as any run, and its outputs are the adapted run's.
"""

import os
import shutil

import jax
import numpy as np

from transformer import rundir
from transformer.layers import lora

NOT_COPIED = (rundir.CONFIG, "metrics.jsonl")


def merge_run(workdir: str, out: str, step: int | None = None) -> dict:
    """Writes `workdir`'s checkpoint `step` (default the latest) with its adapters merged as the run `out`;
    returns {'step', 'params' (their count), 'adapters' (how many kernels were adapted)}."""
    if os.path.exists(os.path.join(out, rundir.CONFIG)):
        raise ValueError(f"{out} already holds a run; choose a new --merge_to")
    run = rundir.open(workdir)
    settings = lora.Lora.of(run.config.get("lora"))
    if not settings.rank:
        raise ValueError(f"{workdir} has no LoRA adapters (config.lora.rank=0): nothing to merge")
    step = run.checkpoint_step(step)
    saved = run.restore_params(step)
    params = jax.tree.map(np.asarray, lora.merged(saved, settings.scale))
    config = run.config.copy_and_resolve_references()
    config.unlock()
    config.lora.rank = 0
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(workdir):
        if os.path.isfile(os.path.join(workdir, name)) and name not in NOT_COPIED:
            shutil.copy2(os.path.join(workdir, name), os.path.join(out, name))
    target = rundir.RunDir(out)
    target.write_config(config)
    ckpt = target.checkpointer()
    ckpt.save_params(params)
    ckpt.wait()
    ckpt.close()
    adapted = len(jax.tree.leaves(saved[lora.ADAPTERS])) // 2
    return {"step": step, "params": sum(x.size for x in jax.tree.leaves(params)), "adapters": adapted}
