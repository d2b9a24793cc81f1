"""Orbax checkpoints of a run: save every N steps, keep the last K, resume from the latest.

A checkpoint holds two items, `params` and `opt_state`, plus the step; restoring
takes an abstract target carrying shardings, so a checkpoint written on one mesh
restores onto another. `generate` restores `params` alone. A converted checkpoint
(`transformer.convert`) holds `params` alone: runs start from it with `init_from`.
"""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp


def abstract_like(tree, shardings):
    """ShapeDtypeStructs of `tree` placed with `shardings` (the restore target)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class Checkpointer:
    """Saves and restores (params, opt_state) of a TrainState under `directory`."""

    def __init__(self, directory: str, keep: int = 3, every: int = 1000, read_only: bool = False):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=max(every, 1),
                                               create=not read_only, read_only=read_only)
        self.manager = ocp.CheckpointManager(
            os.path.abspath(directory), options=options,
            item_handlers={"params": ocp.StandardCheckpointHandler(),
                           "opt_state": ocp.StandardCheckpointHandler()})

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state, force: bool = False) -> bool:
        """Saves if the step is due (or `force`); returns whether it saved."""
        step = int(state.step)
        if step in self.manager.all_steps():
            return False
        return self.manager.save(step, force=force, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state.params),
            opt_state=ocp.args.StandardSave(state.opt_state)))

    def save_params(self, params, step: int = 0) -> None:
        """A checkpoint of the params alone (a converted model: no optimizer state to allocate)."""
        self.manager.save(step, force=True, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))

    def restore(self, state, shardings, step: int | None = None):
        """`state` (arrays or abstract) with params and opt_state from the checkpoint."""
        step = self.latest_step() if step is None else step
        if not os.path.isdir(os.path.join(str(self.manager.directory), str(step), "opt_state")):
            raise ValueError(f"{self.manager.directory}/{step} holds weights only (a converted model): start a new "
                             f"run from it with --config.init_from={os.path.dirname(str(self.manager.directory))}")
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_like(state.params, shardings.params)),
            opt_state=ocp.args.StandardRestore(abstract_like(state.opt_state, shardings.opt_state))))
        return state.replace(step=jax.device_put(np.int32(step), shardings.step),
                             params=restored.params, opt_state=restored.opt_state)

    def restore_params(self, step: int | None = None, sharding=None):
        """Only the params, each whole on one of this process's devices (or placed by `sharding`),
        whatever mesh saved them."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.manager.directory}")
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        saved = self.manager.item_metadata(step)["params"].tree
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), saved)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract)))
        return restored.params

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
