"""A run's checkpoints/: orbax checkpoints of `params` and `opt_state` by step, saved only with finite parameters
and where the disk has room for them, and restored from the newest one that reads whole.

A save that fails (a full disk) stops the run in one line naming the path and the space it needs, and leaves no
temporary files; a launch removes those a killed save left. A resumed run or an evaluation skips a latest
checkpoint that does not read whole (a truncated file, an empty manifest) or holds non-finite parameters, saying
which and why; training then moves it to checkpoints.skipped/ and saves that step again, as it does with the
checkpoints after the one a relaunch resumes from (`rewind`, train --resume_step). A checkpoint of other shapes
than the config makes (one saved under another config) is never set aside: it reads under its own.
"""

import contextlib
import errno
import functools
import gc
import glob
import os
import shutil
import sys
import tempfile
import time
from typing import NoReturn

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from flax import traverse_util


@functools.cache
def _one_copy_per_array_on_cpus() -> None:
    """On CPU devices (one host memory) an array is saved from one replica: orbax's default copies a slice from
    each replica, eight copies on eight CPU devices (a tiny GPT's save: 0.8 -> 0.25 s)."""
    if jax.devices()[0].platform != "cpu":
        return
    try:
        from orbax.checkpoint._src.metadata import array_metadata_store  # what orbax's own default handler keeps
        store = array_metadata_store.Store()
    except ImportError:
        return
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False, array_metadata_store=store),
        override=True)


@contextlib.contextmanager
def _quiet_unless_whole():
    """Holds back what is written to stderr (file descriptor 2) inside, and lets it out where the block appends
    True to the list it is given: a failed restore's pending TensorStore reads print a traceback each into
    orbax's closed event loop, which the line the restore's error makes says in one."""
    sys.stderr.flush()
    saved, whole = os.dup(2), []
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield whole
        finally:
            if not all(whole):
                time.sleep(0.2)  # the pending reads end
                gc.collect()  # and their failed coroutines are finalised (each prints its error)
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if all(whole):
                held.seek(0)
                sys.stderr.write(held.read().decode(errors="replace"))


def _free(directory) -> int | None:
    """The bytes free on `directory`'s filesystem; None where it has no local one (a bucket)."""
    try:
        return shutil.disk_usage(os.fspath(directory)).free
    except (OSError, TypeError):
        return None


class SaveFailed(OSError):
    """A checkpoint could not be written (a full disk): the run stops there."""


class WeightsOnly(ValueError):
    """A converted model's checkpoint, restored as a run's."""


class OtherShapes(ValueError):
    """A checkpoint restored onto the shapes of another config than the one that saved it (never removed)."""


OTHER_SHAPES = ("Requested shape", "stored shape", "does not match the checkpoint")  # orbax's words for it


@jax.jit
def finite(tree) -> jax.Array:
    """Whether every floating-point array of `tree` is finite."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _short(e: BaseException, limit: int = 160) -> str:
    """An error's first line, cut at TensorStore's spec and at `limit` characters."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0].split(" [tensorstore_spec")[0]
    text = text.split(" See full TensorStore details")[0]
    return text if len(text) <= limit else text[:limit] + "..."


def _other_shape(saved, wanted) -> str | None:
    """The first array whose stored shape (`saved`, orbax's metadata tree) is not `wanted`'s, in words."""
    stored = traverse_util.flatten_dict(saved, sep="/")
    for name, x in traverse_util.flatten_dict(wanted, sep="/").items():
        if name not in stored:
            return f"no array {name} in it"
        if tuple(stored[name].shape) != tuple(x.shape):
            return f"{name} is {tuple(stored[name].shape)} there, {tuple(x.shape)} here"
    return None


def _other_shapes(directory, step: int, what: str) -> OtherShapes:
    return OtherShapes(f"{directory}/{step} holds arrays of other shapes than this config makes ({what}): it reads "
                       "under the run's own config.json; launch with that")


def abstract_like(tree, shardings):
    """ShapeDtypeStructs of `tree` placed with `shardings` (the restore target)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class Checkpointer:
    """Saves and restores (params, opt_state) of a TrainState under `directory`, and the step.

    Restoring takes an abstract target carrying shardings, so a checkpoint written on one mesh
    restores onto another. A converted model's checkpoint holds `params` alone: runs start from
    it with config.init_from.
    """

    def __init__(self, directory: str, keep: int = 3, every: int = 1000, read_only: bool = False):
        interval = 0 if read_only else max(every, 1)  # a reader's: orbax warns where it sets them itself
        options = ocp.CheckpointManagerOptions(max_to_keep=None if read_only else keep, save_interval_steps=interval,
                                               create=not read_only, read_only=read_only,
                                               cleanup_tmp_directories=not read_only)  # a killed save's
        self.failed, self.saving = None, None  # the error of a save that failed; the step being saved
        _one_copy_per_array_on_cpus()
        verbosity = absl_logging.get_verbosity()
        absl_logging.set_verbosity(min(verbosity, absl_logging.ERROR) if read_only else verbosity)
        try:
            self.manager = ocp.CheckpointManager(
                os.path.abspath(directory), options=options,
                item_handlers={"params": ocp.StandardCheckpointHandler(),
                               "opt_state": ocp.StandardCheckpointHandler()})
        finally:
            absl_logging.set_verbosity(verbosity)
        self._await_cleanup()

    def _await_cleanup(self) -> None:
        """Waits for orbax's background removal of a killed save's temporary folders: a launch that fails right
        after opening its checkpoints would otherwise exit under that thread, whose traceback follows the error."""
        getattr(self.manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def newest_whole(self, restore, params_of) -> tuple[object, list[int]]:
        """`restore(step)` of the newest checkpoint that reads whole and holds finite parameters
        (`params_of(restored)`), and the newer steps that do not, each said in a line on stderr; where
        none does, the latest one's error, in one line naming it."""
        skipped, first_error = [], None
        for step in sorted(self.manager.all_steps(), reverse=True):
            with _quiet_unless_whole() as whole:
                try:
                    restored = restore(step)
                    reason = None if finite(params_of(restored)) else "its parameters are not finite"
                except (WeightsOnly, OtherShapes):
                    raise
                except Exception as e:  # orbax and TensorStore raise bare Exceptions for a truncated file
                    if any(said in str(e) for said in OTHER_SHAPES):
                        whole.append(False)
                        self.close()
                        raise _other_shapes(self.manager.directory, step, _short(e)) from None
                    reason = f"it does not read whole ({_short(e)})"
                whole.append(reason is None)
            if reason is None:
                return restored, skipped
            first_error = first_error or f"{self.manager.directory}/{step}: {reason}"
            print(f"checkpoint {step} skipped: {reason}", file=sys.stderr)
            skipped.append(step)
        self.close()  # its pending reads otherwise print tracebacks at exit
        raise ValueError(f"no whole checkpoint with finite parameters: {first_error}; remove it (or the run's "
                         f"{os.path.basename(str(self.manager.directory))}/ folder, to start again)")

    def rewind(self, step: int) -> None:
        """Sets aside (`set_aside`) every checkpoint after `step`, a kept one, so that the run resumes from it; a
        step not kept fails naming those kept."""
        kept = sorted(self.manager.all_steps())
        if step not in kept:
            raise ValueError(f"--resume_step={step}: {self.manager.directory} keeps the checkpoints of steps "
                             f"{', '.join(map(str, kept)) or 'none'}: choose one of them")
        self.set_aside([s for s in kept if s > step])
        self.manager.reload()

    def set_aside(self, steps: list[int]) -> None:
        """Moves checkpoints `steps` out of the run's way, into checkpoints.skipped/ beside checkpoints/ (so the
        resumed run saves those steps again), and says so; process 0 moves them."""
        if not steps or jax.process_index() != 0:
            return
        directory = str(self.manager.directory)
        aside = directory.rstrip("/") + ".skipped"
        os.makedirs(aside, exist_ok=True)
        for step in steps:
            target = os.path.join(aside, str(step))
            shutil.rmtree(target, ignore_errors=True)
            os.replace(os.path.join(directory, str(step)), target)
        self.manager.reload()
        print(f"checkpoint{'s' * (len(steps) > 1)} {', '.join(map(str, steps))} moved to {aside} (delete once looked "
              "at)", file=sys.stderr)

    def save(self, state, force: bool = False) -> bool:
        """Saves if the step is due (or `force`), in the background; returns whether it saved. Where the disk
        lacks the room, or an earlier save failed, raises `SaveFailed` (nothing of the save left behind)."""
        step = int(state.step)
        if step in self.manager.all_steps():
            return False
        self.wait()
        arrays = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((state.params, state.opt_state)))
        needed = int(arrays * 1.1) + (1 << 20)  # with orbax's metadata
        free = _free(self.manager.directory)
        if free is not None and free < needed:
            self._fail(step, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), needed)
        try:
            saved = self.manager.save(step, force=force, args=ocp.args.Composite(
                params=ocp.args.StandardSave(state.params),
                opt_state=ocp.args.StandardSave(state.opt_state)))
        except Exception as e:  # orbax raises what TensorStore or the filesystem gives
            self._fail(step, e, needed)
        self.saving = (step, needed) if saved else None
        return saved

    def check(self) -> None:
        """Raises `SaveFailed` where the last background save has ended uncommitted (a full disk), having
        removed what it wrote; nothing while it runs."""
        if self.saving is None or self.manager.is_saving_in_progress():
            return
        step, needed = self.saving
        self.saving = None
        if os.path.isdir(os.path.join(str(self.manager.directory), str(step))):
            return
        try:
            self.manager.check_for_errors()
            error = RuntimeError("it was not committed")
        except Exception as e:  # orbax's finalizing thread may have taken it already (and logged it)
            error = e
        self._fail(step, error, needed)

    def _fail(self, step: int, error: BaseException, needed: int) -> NoReturn:
        """Removes the temporary folders of unfinished saves and raises `SaveFailed` in one line."""
        self.failed = error
        for partial in glob.glob(os.path.join(str(self.manager.directory), "*.orbax-checkpoint-tmp*")):
            shutil.rmtree(partial, ignore_errors=True)
        path = os.path.join(str(self.manager.directory), str(step))
        text = str(error)
        free = _free(self.manager.directory)
        full = (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left" in text \
            or f"os_error_code='{errno.ENOSPC}'" in text or (free is not None and free < needed)
        reason = "the disk is full" if full else _short(error)
        kept = [s for s in self.manager.all_steps(read=True) if s != step]
        room = f", {free / 1e6:,.1f} MB are free there" if free is not None else ""
        whole = f"checkpoint {max(kept)} is whole" if kept else "no checkpoint was saved"
        raise SaveFailed(f"saving checkpoint {step} to {path} failed: {reason} (it needs {needed / 1e6:,.1f} MB"
                         f"{room}); stopped, {whole}: make room and run the same command to resume")

    def save_params(self, params, step: int = 0) -> None:
        """A checkpoint of the params alone (a converted model: no optimizer state to allocate)."""
        self.manager.save(step, force=True, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))

    def restore(self, state, shardings, step: int | None = None):
        """`state` (arrays or abstract) with params and opt_state from the checkpoint."""
        step = self.latest_step() if step is None else step
        if not os.path.isdir(os.path.join(str(self.manager.directory), str(step), "opt_state")):
            raise WeightsOnly(f"{self.manager.directory}/{step} holds weights only (a converted model): start a new "
                             f"run from it with --config.init_from={os.path.dirname(str(self.manager.directory))}")
        other = _other_shape(self.manager.item_metadata(step)["params"].tree, state.params)
        if other:
            raise _other_shapes(self.manager.directory, step, other)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_like(state.params, shardings.params)),
            opt_state=ocp.args.StandardRestore(abstract_like(state.opt_state, shardings.opt_state))))
        return state.replace(step=jax.device_put(np.int32(step), shardings.step),
                             params=restored.params, opt_state=restored.opt_state)

    def restore_params(self, step: int | None = None, shardings=None):
        """Only the params, placed by `shardings` (a tree like them), else each whole on one of this
        process's devices, whatever mesh saved them."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.manager.directory}")
        saved = self.manager.item_metadata(step)["params"].tree
        if shardings is None:
            shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.local_devices()[0]), saved)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_like(saved, shardings))))
        return restored.params

    def wait(self) -> None:
        """Waits for the background save; `SaveFailed` where it failed (already said where one had)."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            if self.failed is None and self.saving is not None:
                self._fail(*self.saving, e)
        if self.failed is None:
            self.check()

    def close(self) -> None:
        try:
            self.manager.close()
        except Exception:
            if self.failed is None:
                raise
