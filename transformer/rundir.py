"""A run directory: what a run keeps in its workdir, and the one place that opens it.

  .lock                   held by the process training in it (`hold`): a second launch fails, naming it
  config.json             the resolved config; a resumed run must keep its model (`write_config`); one written
                          before a key existed is read with that key's default (`read_config`)
  checkpoints/STEP/       orbax checkpoints of `params` and `opt_state` (the last train.keep_checkpoints);
                          a converted model's (`transformer.convert`) hold `params` alone, at step 0
  metrics.jsonl, tb/      one JSON object per logged step (train/*, eval/*), and TensorBoard events of them
  trackers.json, wandb/   the run ids of config.train.trackers (a resumed run goes on in the same ones), and an
                          offline or online Weights & Biases run's local folder (training/trackers.py)
  evals.jsonl             one JSON object per `transformer.evaluate`: step, overrides and eval/* metrics (the
                          harness's task results too)
  tokenizer_config.json   the tokenizer (with tokenizer.json, or its SentencePiece model)
  data.json               a token-store run's data record: its stores, its tokenizer's fingerprint and the
                          stores' weights from each step (`transformer.data.text.lm_streams` writes it)
  store/ images/ data/    data the run made for itself (a tokenized store, an image index and statistics, an
                          embedded task's files)
  labels.json             a classifier's label names by id (`read_labels`, which an image index's classes
                          stand in for; `save_labels`)
  chat_template.json      a chat model's format: its template and markers (`chat_format`; an SFT run's, or
                          an imported model's `chat_template`)
  reference_logps.npz     a DPO run's starting-policy log-probs of its pairs' responses (eval_reference_logps.npz
                          of its held-out ones), kept for a resume
  rollouts/               a GRPO run's held rollout batch (train_batch.npz) and each eval's rollouts
  profile/ probes/        a profiler trace window, and the plots of `transformer.probe`

Reading a run (generate, chat, serve, the harness, probe, init_from, a post-training task's start):

    run = rundir.open("runs/gpt-tiny")
    run.config, run.family, run.latest_step, run.data_record
    model, params, tokenizer = run.model(), run.restore_params(), run.tokenizer()
    run.chat_format(), run.stop_ids()                  # its ChatFormat or None; where what it writes ends
    params = run.restore_onto(target)                  # laid out (scanned or not) and placed as target's params
    model.apply({"params": params}, tokenizer.encode("a text")[None])  # a BERT's framed as it trained: [CLS] ... [SEP]
    params = run.restore_params(step=200, mesh=mesh)   # placed by the run's own config.mesh.rules
    run.steps, run.labels                              # its checkpoints' steps; a classifier's label names
    run.checkpoint_step(None)                          # the latest step (a step it has not fails, naming those)
    step, params = run.restore_latest()                # the latest whole, finite checkpoint (a later one skipped)
    run.with_overrides({"data.eval_path": "test.tsv"})  # read with another eval set (transformer.evaluate)

A trained classifier as a function of raw inputs is `transformer.inference.classifier.Classifier(run)`.
Training keeps its state through `run.checkpointer(keep, every)`: a checkpoint restores onto any mesh,
since the restore takes its target's shardings.
"""

import builtins
import fcntl
import functools
import json
import os
import pathlib
import socket

import jax
import numpy as np

from transformer import config as config_lib
from transformer import models, sharding
from transformer.checkpoints import Checkpointer
from transformer.data.images import palette
from transformer.data.images.folders import INDEX_DIR
from transformer.data.text import chat_templates, lm_streams, sentencepiece_tokenizer, store_encoding, tokenizers
from transformer.models import common

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
LABELS = "labels.json"
EVALS = "evals.jsonl"  # appended by each evaluation (training/evaluation.py, training/harness_tasks.py)
LOCK = ".lock"  # held by the run training in the workdir (`hold`); a sweep's trial is handed its sweep's
CLASSIFYING = ("sequence_classification", "token_classification", "image_classification")
FRAMES = {"bert": (("[CLS]",), ("[SEP]",))}  # family -> the special tokens its tasks put around a text

# config.model keys that change how a step computes, not what the weights are: a run may resume with others
# (the memory check's advice, model.remat=auto, must not cost the run its checkpoints).
HOW_IT_COMPUTES = ("remat", "attention", "attention_block", "loss_block", "dtype")


def open(workdir: str) -> "RunDir":
    """The run directory `workdir`, which must hold a config.json (a trained or converted run)."""
    path = os.path.join(workdir, CONFIG)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is --workdir a run directory?")
    return RunDir(workdir)


def starting_model(workdir: str, config_file: str) -> dict:
    """config.model of the run a post-training config file (`config_file`) starts from (its `read_config`)."""
    if not workdir:
        raise ValueError(f"{config_file} needs the run it trains: {config_file}:init_from=WORKDIR")
    if not os.path.isfile(os.path.join(workdir, CONFIG)):
        raise FileNotFoundError(f"init_from={workdir}: no {os.path.join(workdir, CONFIG)} (a trained or converted "
                                f"run's workdir)")
    return open(workdir).config.model.to_dict()


def resumed_config(workdir: str, overrides: dict[str, str]):
    """The config of the run in `workdir` (its config.json) with `overrides` (dotted keys and values as
    --config.KEY=VALUE gives them), locked; a model or LoRA key whose change would orphan the run's
    checkpoints (`refuse_another_model`) fails naming it. `python -m transformer.train --workdir DIR` runs it
    (cli.run's resume)."""
    if not os.path.exists(os.path.join(workdir, CONFIG)):
        raise FileNotFoundError(f"no run to resume in {workdir} (no {CONFIG}): pass --config, e.g. "
                                f"--config configs/gpt.py:tiny")
    saved = open(workdir).config
    config = saved.copy_and_resolve_references()
    config_lib.apply_overrides(config, overrides)
    refuse_another_model(saved, config, workdir)
    config.lock()
    return config


def hold(workdir: str):
    """Creates `workdir` and holds WORKDIR/.lock (fcntl.flock) until the returned file is closed or the
    process ends, however it ends: one run trains in a workdir at a time, and a dead one holds nothing. A
    workdir another live process holds fails in one line naming it; a lock this process was handed (a
    sweep's trial inherits its sweep's) counts as its own."""
    try:
        os.makedirs(workdir, exist_ok=True)
        lock = builtins.open(os.path.join(workdir, LOCK), "a+")
    except OSError as e:
        raise OSError(f"cannot create the workdir {workdir}: {e.strerror}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if not _handed(lock):
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise ValueError(f"{workdir} is in use by a run that is still training or saving ({holder}, holding "
                             f"{os.path.join(workdir, LOCK)}): wait for it to end, or stop it") from None
    lock.truncate(0)
    lock.write(f"process {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    return lock


def _handed(lock) -> bool:
    """Whether this process holds `lock`'s file through another descriptor it inherited (flock belongs to the
    open file, which a child shares)."""
    mine = os.fstat(lock.fileno())
    for name in os.listdir("/dev/fd") if os.path.isdir("/dev/fd") else []:
        try:
            fd = int(name)
            if fd != lock.fileno() and os.path.samestat(os.fstat(fd), mine):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
        except (ValueError, OSError):
            continue
    return False


class RunDir:
    """A workdir's config, tokenizer, data record and checkpoints (each read when first asked for)."""

    def __init__(self, path: str):
        self.path = path
        self.tokenizers = {}  # framed -> the one tokenizer object of each kind (`tokenizer`)

    @functools.cached_property
    def config(self):
        """The config the run was trained (or converted) with (`read_config`)."""
        return read_config(os.path.join(self.path, CONFIG))

    @property
    def family(self):
        return models.family(self.config.model.family)

    def model(self):
        """The run's module, as config.model builds it."""
        return models.build(self.config.model, self.config.get("lora"))

    def tokenizer(self, framed: bool = True) -> tokenizers.Tokenizer:
        """The run's tokenizer. `framed`: its `encode` gives a text as training fed it to the model ([CLS] text
        [SEP] for a BERT; `tokenizers.Framed`, whose `pieces` is the text alone). The library, which places
        special tokens itself, reads it unframed). An ImageGPT run's is its palette. Read once: each call
        answers the same object."""
        if framed not in self.tokenizers:
            if palette.is_saved(self.path):
                self.tokenizers[framed] = palette.load(self.path)
            else:
                frame = FRAMES.get(self.config.model.family)
                plain = self.tokenizer(framed=False) if framed and frame else tokenizers.load_tokenizer(self.path)
                self.tokenizers[framed] = tokenizers.Framed(plain, *frame) if framed and frame else plain
        return self.tokenizers[framed]

    def chat_format(self, required: bool = False) -> chat_templates.ChatFormat | None:
        """The run's chat format (its chat_template.json, over `tokenizer(framed=False)`; read once); None for a
        run without one, or with `required` a FileNotFoundError that says how to make one."""
        if self._chat is None and required:
            raise FileNotFoundError(f"{os.path.join(self.path, chat_templates.FILE)} not found: {self.path} is not a "
                                    f"chat model; fine-tune it with --config configs/sft.py:init_from={self.path}")
        return self._chat

    @functools.cached_property
    def _chat(self) -> chat_templates.ChatFormat | None:
        path = os.path.join(self.path, chat_templates.FILE)
        return chat_templates.from_saved(self.tokenizer(framed=False), path) if os.path.isfile(path) else None

    def stop_ids(self, chat: bool = True) -> tuple[int, ...]:
        """The ids where what the run writes ends: its chat format's end-of-turn markers (with `chat`, where it
        has one), else its tokenizer's end of document (`store_encoding.end_of_document_id`), else none."""
        if chat and self.chat_format() is not None:
            return self.chat_format().end_ids
        try:
            return (store_encoding.end_of_document_id(self.tokenizer(framed=False)),)
        except ValueError:
            return ()

    @property
    def data_record(self) -> dict | None:
        """What the run trained on (data.json: its stores, tokenizer and weights), None for a run without
        token stores."""
        path = pathlib.Path(self.path, lm_streams.RECORD)
        return json.loads(path.read_text()) if path.exists() else None

    def write_config(self, config) -> None:
        """Creates the workdir and writes config.json (process 0); a ValueError where it holds the
        checkpoints of another model."""
        self.check_model(config)
        if jax.process_index() == 0:
            config_lib.save_json(config, os.path.join(self.path, CONFIG))
        self.__dict__.pop("config", None)  # read again when asked for

    def check_model(self, config) -> None:
        """Creates the workdir; a ValueError where its checkpoints are of another model."""
        os.makedirs(self.path, exist_ok=True)
        path = os.path.join(self.path, CONFIG)
        if os.path.exists(path) and self.has_checkpoints():
            refuse_another_model(read_config(path), config, self.path)

    def has_checkpoints(self) -> bool:
        """Whether checkpoints/ holds any step (a failed launch leaves it empty)."""
        directory = os.path.join(self.path, CHECKPOINTS)
        return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))

    def forget_failed_launch(self, config) -> None:
        """Where no checkpoint was saved, removes what an earlier launch made for its own settings and a
        corrected command would refuse (the data record, tokenizer, labels, a store of other settings)."""
        if self.has_checkpoints() or jax.process_index() != 0:
            return
        for name in (lm_streams.RECORD, tokenizers.CONFIG_FILE, tokenizers.HF_FILE, sentencepiece_tokenizer.MODEL_FILE,
                     LABELS):
            if os.path.isfile(os.path.join(self.path, name)):
                os.remove(os.path.join(self.path, name))
        lm_streams.drop_stale_store(config, self.path)

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
        config = read_config(os.path.join(self.path, CONFIG))
        config_lib.apply_overrides(config, overrides)
        changed = RunDir(self.path)
        changed.config = config
        return changed

    @property
    def classifies(self) -> str | None:
        """The run's classification task (one of CLASSIFYING), None for a model that does not classify."""
        try:
            task = models.task_of(self.config.model)
        except ValueError:  # a model without a head has no task
            return None
        return task if task in CLASSIFYING else None

    @property
    def labels(self) -> list[str] | None:
        """A classifier's label names by id, as many as its logits: those it recorded (`read_labels`), the
        rest as their ids ('0', '1', ...); None for a model that does not classify."""
        if self.classifies is None:
            return None
        m = self.config.model
        count = m.num_labels if "num_labels" in m else m.num_classes
        names = read_labels(self.path) or []
        return [*names, *map(str, range(len(names), count))]

    def restore_params(self, step: int | None = None, mesh=None):
        """The params of checkpoint `step` (default: the latest whole one, a corrupt or non-finite later one
        skipped and said): each weight whole on one of this process's devices, whatever mesh saved them, or
        with `mesh` placed by the run's own config.mesh.rules."""
        if step is not None:
            return self._reader.restore_params(self.checkpoint_step(step),
                                              None if mesh is None else self.param_shardings(mesh))
        return self.restore_latest(mesh)[1]

    def restore_latest(self, mesh=None) -> tuple[int, object]:
        """(step, params) of the latest checkpoint that reads whole with finite parameters (a later one
        skipped is said), placed as `restore_params` places them."""
        self.checkpoint_step()  # fails where there is none
        shardings = None if mesh is None else self.param_shardings(mesh)
        restored, _ = self._reader.newest_whole(lambda s: (s, self._reader.restore_params(s, shardings)),
                                                lambda pair: pair[1])
        return restored

    def restore_onto(self, target, step: int | None = None, place: bool = True):
        """The params of checkpoint `step` (default: the latest whole one) laid out as `target` (a model's params,
        or their shapes): layer stacks scanned or unscanned as target's (`common.match_layers`) and, with
        `place`, each weight on the sharding of target's (the two trees then the same)."""
        saved = common.match_layers(self.restore_params(step), target)
        if not place:
            return saved
        return jax.tree.map(lambda s, t: jax.device_put(np.asarray(s), t.sharding), saved, target)

    def param_shardings(self, mesh):
        """The params' NamedShardings on `mesh` by the run's config.mesh.rules (nothing allocated)."""
        model = self.model()
        boxed = jax.eval_shape(model.init, jax.random.key(0), *self.family.example_inputs(model))["params"]
        return sharding.logical_shardings(boxed, mesh, sharding.rules_of(self.config.mesh))


def read_config(path: str):
    """A run's config.json, upgraded where it was written before a key existed: each key that config.model
    (its family's fields), config.train, optim and mesh have since gets its default, so that every reader
    finds every key."""
    config = config_lib.from_json(path)
    defaults = {"model": common.fields_of(models.family(config.model.family).module),
                "train": config_lib.train_config().to_dict(), "optim": config_lib.optim_config().to_dict(),
                "mesh": config_lib.mesh_config().to_dict()}
    for section, values in defaults.items():
        if section in config:
            for key, value in values.items():
                if key not in config[section]:
                    config[section][key] = value
    return config


def read_labels(workdir: str) -> list[str] | None:
    """The names a run gives its label ids: its labels.json (a text classifier's, a converted classifier's),
    else the class folders its image index found; None where its labels are ids alone."""
    path = os.path.join(workdir, LABELS)
    if os.path.isfile(path):
        return json.loads(pathlib.Path(path).read_text())
    index = os.path.join(workdir, INDEX_DIR, "index.json")
    return json.loads(pathlib.Path(index).read_text())["classes"] if os.path.isfile(index) else None


def save_labels(workdir: str, names: list[str]) -> None:
    """workdir/labels.json: the label names by id (written by the first process)."""
    if jax.process_index() == 0:
        pathlib.Path(workdir, LABELS).write_text(json.dumps(names))


def changed_key(saved, current) -> tuple[str, object, object] | None:
    """(key, saved value, current value) of the first key that makes `current`'s weights other than those of the
    run `saved` (its config as `read_config` upgrades it): a model key but HOW_IT_COMPUTES, or a LoRA key where
    either has adapters (a config without config.lora has none); None where the checkpoints fit `current`."""
    old, new = saved.model.to_dict(), current.model.to_dict()
    for key in ("family", *sorted(set(old) | set(new))):
        if key not in HOW_IT_COMPUTES and old.get(key) != new.get(key):
            return f"model.{key}", old.get(key), new.get(key)
    old, new = ({**config_lib.lora_config().to_dict(), **(c.lora.to_dict() if "lora" in c else {})}
                for c in (saved, current))
    if old["rank"] or new["rank"]:
        for key in sorted(old):
            if old[key] != new[key]:
                return f"lora.{key}", old[key], new[key]
    return None


def refuse_another_model(saved, current, workdir: str) -> None:
    """A ValueError naming the key where `current` would not restore the checkpoints of the run in `workdir`
    (`changed_key`), which read whole under the run's own config."""
    changed = changed_key(saved, current)
    if changed is not None:
        key, old, new = changed
        raise ValueError(f"config.{key}={new!r}: the run in {workdir} has {key}={old!r}, and its checkpoints are of "
                         f"another model than this: resume with {key}={old!r}, or start a new --workdir")
