"""An experiment file read into its trials: the config it names, each trial's overrides applied and
checked before anything runs, a folder name per trial, the sweep's record in DIR/sweep.json, and one
index of an image folder for the trials that read it.
"""

import copy
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
from collections import Counter

import ml_collections

from transformer import cli
from transformer import config as config_lib
from transformer.data.images import folders
from transformer.sweep import results
from transformer.training import checks


@dataclasses.dataclass
class Experiment:
    path: str
    config_spec: str
    trials: dict[str, dict]  # trial name -> overrides, in get_sweep's order
    steps: int  # the fewest train.steps of any trial
    configs: dict[str, ml_collections.ConfigDict] = dataclasses.field(default_factory=dict)  # trial name -> config


def load_experiment(path: str) -> Experiment:
    """Reads an experiment file: its config and its trials, each a non-empty dict whose overrides
    apply to the config. A problem is a one-line ValueError (FileNotFoundError) naming the file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"experiment file not found: {path}")
    module = _guarded(path, "running the file", lambda: _exec_file(path))
    config_spec, config = _base_config(path, module)
    if not hasattr(module, "get_sweep"):
        raise ValueError(f"{path}: define get_sweep() returning a list of override dicts")
    trials = _guarded(path, "get_sweep()", module.get_sweep)
    if not isinstance(trials, (list, tuple)):
        raise ValueError(f"{path}: get_sweep() returned a {type(trials).__name__}, not a list of override dicts "
                         "(e.g. sweep.grid({...}))")
    configs = [_trial_config(path, config, t, i, len(trials)) for i, t in enumerate(trials, 1)]
    names = trial_names(path, trials)
    return Experiment(path, config_spec, names, min(c.train.steps for c in configs), dict(zip(names, configs)))


def _exec_file(path: str):
    spec = importlib.util.spec_from_file_location("_experiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _guarded(path: str, what: str, fn):
    """fn(), an exception from the experiment's own code turned into one line naming the file."""
    try:
        return fn()
    except Exception as e:
        raise ValueError(f"{path}: {what} raised {type(e).__name__}: {cli.one_line(e)[:300]}") from None


def _base_config(path: str, module) -> tuple[str, ml_collections.ConfigDict]:
    """The experiment's config spec (what its trials' --config get) and the config it loads."""
    if hasattr(module, "get_config"):
        arg = getattr(module, "CONFIG_ARG", "")
        spec, what, load = f"{path}:{arg}", f"get_config({arg!r})", lambda: module.get_config(arg)
    elif hasattr(module, "CONFIG"):
        spec, what, load = module.CONFIG, f"loading CONFIG {module.CONFIG}", lambda: config_lib.load(module.CONFIG)
        if not os.path.exists(spec.partition(":")[0]):
            raise FileNotFoundError(f"{path}: CONFIG names {spec.partition(':')[0]}, which is not "
                                    "there (paths are relative to where the sweep is launched)")
    else:
        raise ValueError(f"{path}: define get_config(arg) or CONFIG = 'configs/FAMILY.py:ARG'")
    config = _guarded(path, what, load)
    if not (isinstance(config, ml_collections.ConfigDict) and "steps" in config.get("train", {})):
        raise ValueError(f"{path}: {what} gave {type(config).__name__}, not a ConfigDict with train.steps")
    return spec, config


def _trial_config(path: str, config, overrides, index: int, count: int):
    """The config with the trial's overrides applied, as its run will load it, and checked as its
    run will check it (sizes that do not fit together fail here, not when the trial starts)."""
    if not (isinstance(overrides, dict) and overrides and all(isinstance(k, str) for k in overrides)):
        raise ValueError(f"{path}: trial {index} of {count} is {overrides!r:.100}, not a non-empty dict "
                         "{'section.key': value}")
    config = copy.deepcopy(config)
    try:
        config_lib.apply_overrides(config, {k: str(v) for k, v in overrides.items()})
        checks.validate(config)
    except cli.CONFIG_ERRORS as e:
        described = ",".join(f"{k}={format_value(v)}" for k, v in overrides.items())
        raise ValueError(f"{path}: trial {index} ({described:.120}): {cli.one_line(e)[:300]}") from None
    return config


MAX_NAME = 200  # characters of a trial's folder name (the filesystem allows 255 bytes)


def format_value(value) -> str:
    """A value as a trial's name spells it: a float in the shortest form that reads back exactly."""
    return float.__repr__(value) if isinstance(value, float) else str(value)


def trial_name(overrides: dict) -> str:
    """{'optim.lr': 0.001, 'model.d_model': 128} -> 'optim.lr=0.001,model.d_model=128' (safe as a
    folder name); a name longer than MAX_NAME is cut and ends in '~' and a hash of the overrides."""
    text = ",".join(f"{k}={format_value(v)}" for k, v in overrides.items())
    name = re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)
    return name if len(name) <= MAX_NAME else _hashed(name, overrides)


def _hashed(name: str, overrides: dict) -> str:
    digest = hashlib.sha1(_canonical(overrides).encode()).hexdigest()[:8]
    return f"{name[:MAX_NAME - 9]}~{digest}"


def _canonical(overrides: dict) -> str:
    return json.dumps(overrides, sort_keys=True, default=repr)


def trial_names(path: str, trials: list[dict]) -> dict[str, dict]:
    """{name: overrides}. Different trials that one name would spell (a folder name replaces
    '/' and spaces) are told apart by a hash of their overrides; the same trial twice is an error."""
    first = {}
    for i, t in enumerate(trials, 1):
        if first.setdefault(_canonical(t), i) != i:
            raise ValueError(f"{path}: get_sweep() lists the same trial twice (trials {first[_canonical(t)]} and "
                             f"{i}: {_canonical(t):.120})")
    counts = Counter(trial_name(t) for t in trials)
    return {trial_name(t) if counts[trial_name(t)] == 1 else _hashed(trial_name(t), t): t for t in trials}


def write_settings(workdir: str, experiment: Experiment, metric: str, mode: str) -> None:
    """Records the sweep in DIR/sweep.json (its trials by name); a ValueError where DIR holds a
    sweep of another config, whose finished trials would be taken for this one's."""
    recorded = results.read_settings(workdir).get("config")
    if recorded not in (None, experiment.config_spec):
        raise ValueError(f"{workdir} holds a sweep of {recorded} (its sweep.json), not of {experiment.config_spec}: "
                         "give a new --workdir")
    with open(os.path.join(workdir, "sweep.json.tmp"), "w") as f:
        json.dump({"experiment": experiment.path, "config": experiment.config_spec, "metric": metric,
                   "mode": mode, "trials": list(experiment.trials)}, f, indent=2)
    os.replace(os.path.join(workdir, "sweep.json.tmp"), os.path.join(workdir, "sweep.json"))


def share_image_indexes(experiment: Experiment, workdir: str) -> None:
    """Trials that train on an image folder read one index of it, made here (folders.share_index), instead of
    each scanning the folder; trials whose folder settings differ share per setting."""
    groups = {}
    for name, config in experiment.configs.items():
        d = config.data
        if checks.validate(config) == "image_classification" and folders.is_folder_of_files(d.source):
            key = (os.path.abspath(os.path.expanduser(d.source)), d.val_labels, d.test_fraction)
            groups.setdefault(key, (d, []))[1].append(results.trial_dir(workdir, name))
    for data, trial_dirs in groups.values():
        folders.share_index(data, workdir, trial_dirs, show=True)
