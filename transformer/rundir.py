"""A run directory: what a run keeps in its workdir, and the one place that opens it.

  config.json             the resolved config; a resumed run must keep its model (`write_config`)
  checkpoints/STEP/       orbax checkpoints of `params` and `opt_state` (the last train.keep_checkpoints);
                          a converted model's (`transformer.convert`) hold `params` alone, at step 0
  metrics.jsonl, tb/      one JSON object per logged step (train/*, eval/*), and TensorBoard events of them
  evals.jsonl             one JSON object per `transformer.evaluate`: step, overrides and eval/* metrics
  tokenizer_config.json   the tokenizer (with tokenizer.json, or its SentencePiece model)
  data.json               a token-store run's data record: its stores, its tokenizer's fingerprint and the
                          stores' weights from each step (`transformer.data.text.lm_streams` writes it)
  store/ images/ data/ labels.json   data the run made for itself (a tokenized store, an image index and
                          statistics, an embedded task's files, a classifier's labels)
  profile/ probes/        a profiler trace window, and the plots of `transformer.probe`

Reading a run (generate, probe, init_from):

    run = rundir.open("runs/gpt-tiny")
    run.config, run.family, run.latest_step, run.data_record
    model, params, tokenizer = run.model(), run.restore_params(), run.tokenizer()
    params = run.restore_params(step=200, mesh=mesh)   # placed by the run's own config.mesh.rules
    run.steps, run.labels                              # its checkpoints' steps; a classifier's label names
    run.checkpoint_step(None)                          # the latest step (a step it has not fails, naming those)
    run.classifier()(["a new sentence"])              # [{'label', 'probabilities'}] (training/classifier.py)
    run.with_overrides({"data.eval_path": "test.tsv"})  # read with another eval set (transformer.evaluate)

Training keeps its state through `run.checkpointer(keep, every)`: a checkpoint restores onto any mesh,
since the restore takes its target's shardings.
"""

import dataclasses
import functools
import json
import os
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging

from transformer import config as config_lib
from transformer import models, sharding
from transformer.data.images import palette
from transformer.data.text import lm_streams, tokenizers
from transformer.training import classifier

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"

# config.model keys that change how a step computes, not what the weights are: a run may resume with others
# (the memory check's advice, model.remat=auto, must not cost the run its checkpoints).
HOW_IT_COMPUTES = ("remat", "attention", "attention_block", "loss_block", "dtype")


def open(workdir: str) -> "RunDir":
    """The run directory `workdir`, which must hold a config.json (a trained or converted run)."""
    path = os.path.join(workdir, CONFIG)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is --workdir a run directory?")
    return RunDir(workdir)


def resumed_config(workdir: str, overrides: dict[str, str]):
    """The config of the run in `workdir` (its config.json) with `overrides` (dotted keys and values as
    --config.KEY=VALUE gives them), locked; a model key whose change would orphan the run's checkpoints (all
    but HOW_IT_COMPUTES) fails naming it. `python -m transformer.train --workdir DIR` runs it (cli.run's resume)."""
    if not os.path.exists(os.path.join(workdir, CONFIG)):
        raise FileNotFoundError(f"no run to resume in {workdir} (no {CONFIG}): pass --config, e.g. "
                                f"--config configs/gpt.py:tiny")
    saved = open(workdir).config
    config = saved.copy_and_resolve_references()
    config_lib.apply_overrides(config, overrides)
    for key in overrides:
        section, _, name = key.partition(".")
        old, new = config_lib.leaves(saved)[key], config_lib.leaves(config)[key]
        if section == "model" and name not in HOW_IT_COMPUTES and new != old:
            raise ValueError(f"config.{key}={new!r}: the run in {workdir} has {key}={old!r} and a resumed run keeps "
                             f"its model; start a new --workdir with --config")
    config.lock()
    return config


class RunDir:
    """A workdir's config, tokenizer, data record and checkpoints (each read when first asked for)."""

    def __init__(self, path: str):
        self.path = path

    @functools.cached_property
    def config(self):
        """The config the run was trained (or converted) with."""
        return config_lib.from_json(os.path.join(self.path, CONFIG))

    @property
    def family(self):
        return models.family(self.config.model.family)

    def model(self):
        """The run's module, as config.model builds it."""
        return models.build(self.config.model)

    def tokenizer(self) -> tokenizers.Tokenizer:
        return palette.load(self.path) if palette.is_saved(self.path) else tokenizers.load_tokenizer(self.path)

    @property
    def data_record(self) -> dict | None:
        """What the run trained on (data.json: its stores, tokenizer and weights), None for a run without
        token stores."""
        path = pathlib.Path(self.path, lm_streams.RECORD)
        return json.loads(path.read_text()) if path.exists() else None

    def write_config(self, config) -> None:
        """Creates the workdir and writes config.json (process 0); a ValueError where it holds the
        checkpoints of another model."""
        os.makedirs(self.path, exist_ok=True)
        path = os.path.join(self.path, CONFIG)
        if os.path.exists(path) and os.path.isdir(os.path.join(self.path, CHECKPOINTS)):
            saved = config_lib.from_json(path)
            if not same_model(saved.model.to_dict(), config.model.to_dict()):
                raise ValueError(f"{self.path} holds a run of another model (config.model differs from "
                                 f"{path}); use a new --workdir")
        if jax.process_index() == 0:
            config_lib.save_json(config, path)
        self.__dict__.pop("config", None)  # read again when asked for

    def checkpointer(self, keep: int = 3, every: int = 1000, read_only: bool = False) -> "Checkpointer":
        """Its checkpoints/, kept `keep` at a time and saved every `every` steps (created unless `read_only`)."""
        return Checkpointer(os.path.join(self.path, CHECKPOINTS), keep, every, read_only)

    @functools.cached_property
    def _reader(self) -> "Checkpointer":
        return self.checkpointer(read_only=True)

    @property
    def latest_step(self) -> int | None:
        """The step of its latest checkpoint (as of the first read), None before any."""
        return self._reader.latest_step()

    @property
    def steps(self) -> list[int]:
        """The steps of its checkpoints, in order."""
        return sorted(self._reader.manager.all_steps())

    def checkpoint_step(self, step: int | None = None) -> int:
        """`step`, or the latest; a step the run has no checkpoint of fails naming the steps it has."""
        saved = self.steps
        if not saved:
            raise FileNotFoundError(f"{self.path} holds no checkpoint yet (no {CHECKPOINTS}/STEP)")
        if step is None:
            return saved[-1]
        if step not in saved:
            raise ValueError(f"--step={step}: {self.path} holds checkpoints of steps {', '.join(map(str, saved))}")
        return step

    def with_overrides(self, overrides: dict[str, str]) -> "RunDir":
        """This run read with its config changed by `overrides` ({'data.eval_path': 'test.tsv'}: dotted keys
        and values as --config.KEY=VALUE gives them): another eval set, mesh or batch size; of config.model
        only how it computes (HOW_IT_COMPUTES), since the weights are the run's."""
        weights = [k for k in overrides if k.startswith("model.") and k.split(".")[1] not in HOW_IT_COMPUTES]
        if weights:
            raise ValueError(f"--config.{weights[0]}: a run's weights fix its model; of config.model only "
                             f"{', '.join(HOW_IT_COMPUTES)} may change")
        config = config_lib.from_json(os.path.join(self.path, CONFIG))
        config_lib.apply_overrides(config, overrides)
        changed = RunDir(self.path)
        changed.config = config
        return changed

    @property
    def labels(self) -> list[str] | None:
        """A classifier's label names by id: its labels.json (BERT), an image folder's class folders, else the
        ids as text ('0', '1', ...); None for a model that does not classify."""
        return classifier.label_names(self)

    def classifier(self, step: int | None = None, top_k: int = 0) -> "classifier.Classifier":
        """The run as a function of raw inputs (texts, words, images) -> label probabilities
        (`transformer.training.classifier`)."""
        return classifier.Classifier(self, step, top_k)

    def restore_params(self, step: int | None = None, mesh=None):
        """The params of checkpoint `step` (default: the latest): each weight whole on one of this
        process's devices, whatever mesh saved them, or with `mesh` placed by the run's own
        config.mesh.rules."""
        return self._reader.restore_params(self.checkpoint_step(step),
                                          None if mesh is None else self.param_shardings(mesh))

    def param_shardings(self, mesh):
        """The params' NamedShardings on `mesh` by the run's config.mesh.rules (nothing allocated)."""
        model = self.model()
        boxed = jax.eval_shape(model.init, jax.random.key(0), *self.family.example_inputs(model))["params"]
        return sharding.logical_shardings(boxed, mesh, sharding.rules_of(self.config.mesh))


def same_model(saved: dict, current: dict) -> bool:
    """Whether a run's saved config.model is `current` but for HOW_IT_COMPUTES; a key the saved one lacks
    (added to the family since) counts as its default."""
    if saved.get("family") != current.get("family") or set(saved) - set(current):
        return False
    defaults = {f.name: f.default for f in dataclasses.fields(models.family(current["family"]).module)}
    return all(saved.get(k, defaults.get(k)) == v for k, v in current.items()
               if k != "family" and k not in HOW_IT_COMPUTES)


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
                                               create=not read_only, read_only=read_only)
        verbosity = absl_logging.get_verbosity()
        absl_logging.set_verbosity(min(verbosity, absl_logging.ERROR) if read_only else verbosity)
        try:
            self.manager = ocp.CheckpointManager(
                os.path.abspath(directory), options=options,
                item_handlers={"params": ocp.StandardCheckpointHandler(),
                               "opt_state": ocp.StandardCheckpointHandler()})
        finally:
            absl_logging.set_verbosity(verbosity)

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
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
