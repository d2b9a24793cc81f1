"""A new run's params taken from another run's checkpoint (config.init_from): same paths load, a new head
starts fresh, a vocabulary grown by a chat format's markers keeps the saved rows."""

import os
import sys

import jax
import numpy as np
from flax import traverse_util

from transformer import rundir
from transformer.layers import lora


def init_from(run_dir: str, params, shardings, head=(), new_head: str = "", grow: bool = False):
    """`params` with every weight that the run in `run_dir` also has (same path) taken from it.

    The rest (a new head, say) keeps its fresh initialisation. The weights of a classifier's outputs (`head`)
    start fresh too where `new_head` says why (its labels are not this run's) or their shape differs (another
    number of labels), said in one line; with `grow`, a weight larger along one axis (a vocabulary grown by a
    chat format's markers) takes the saved part, its new rows keeping theirs; any other weight of another
    shape fails. Layer stacks are converted between the scanned and unscanned layouts.
    """
    if not os.path.exists(os.path.join(run_dir, rundir.CHECKPOINTS)):
        raise FileNotFoundError(f"config.init_from={run_dir!r} holds no checkpoints/")
    source = traverse_util.flatten_dict(rundir.RunDir(run_dir).restore_onto(params, place=False), sep="/")
    target, placements = (traverse_util.flatten_dict(t, sep="/") for t in (params, shardings))
    differ = [name for name, value in target.items() if name in source and source[name].shape != value.shape]
    fresh = [name for name in head if name in source and (new_head or name in differ)]
    for name in set(differ) - set(fresh):
        source[name] = _grown(name, source[name], target[name], run_dir, grow)
    loaded = {name: jax.device_put(np.asarray(source[name]), placements[name])  # numpy: placeable on any host
              for name in target if name in source and name not in fresh}
    if jax.process_index() == 0:
        if fresh:
            why = new_head or ", ".join(f"{n} is {source[n].shape} there, {target[n].shape} here" for n in fresh)
            print(f"init_from {run_dir}: a new head ({', '.join(fresh)} start fresh): {why}", file=sys.stderr)
        print(f"init_from {run_dir}: {len(loaded)} of {len(target)} weights loaded; new: "
              f"{described(sorted(set(target) - set(loaded)))}", file=sys.stderr)
    return traverse_util.unflatten_dict({**target, **loaded}, sep="/")


def described(new: list[str]) -> str:
    """The weights that start fresh, LoRA's adapters counted ('48 LoRA weights (lora/...) start fresh')."""
    adapters = [name for name in new if name.split("/", 1)[0] == lora.ADAPTERS]
    others = [name for name in new if name not in adapters]
    said = [f"{len(adapters)} LoRA weights ({lora.ADAPTERS}/...) start fresh"] if adapters else []
    return ", ".join([*others, *said]) or "none"


def _grown(name: str, saved, fresh, run_dir: str, grow: bool) -> np.ndarray:
    """`fresh` with `saved` in its leading part, where they differ along one axis only, `fresh`'s longer."""
    differ = [a for a, (s, f) in enumerate(zip(saved.shape, fresh.shape)) if s != f]
    if not grow or saved.ndim != fresh.ndim or len(differ) != 1 or saved.shape[differ[0]] > fresh.shape[differ[0]]:
        raise ValueError(f"config.init_from: {name} is {saved.shape} in {run_dir} but {fresh.shape} here")
    out = np.array(fresh)
    out[tuple(slice(0, n) for n in saved.shape)] = np.asarray(saved)
    return out
