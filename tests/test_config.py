"""The config from the command line: resuming from --workdir alone, the key listing, misspelt keys, --help."""

import glob
import json
import os
import subprocess
import sys

import pytest
from conftest import FAST_COMPILES

from transformer import config as config_lib
from transformer import config_keys, rundir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A GPT small enough to train two steps in seconds.
SMALL = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.mlp_dim=64", "data.seq_len=32",
         "data.batch_size=2", "data.eval_batches=1", "train.sample_tokens=0", "train.log_every=1", "train.steps=2"]


def command(module: str, *args: str):
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILES}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def saved_run(tmp_path) -> str:
    """A workdir holding the config.json of a tiny GPT run (no checkpoints)."""
    config_lib.save_json(config_lib.load("configs/gpt.py:tiny"), str(tmp_path / "config.json"))
    return str(tmp_path)


@pytest.mark.slow
def test_train_resumes_from_the_workdir_alone_with_overrides(tmp_path):
    workdir = str(tmp_path / "run")
    first = command("transformer.train", "--config", "configs/gpt.py:tiny", "--workdir", workdir,
                    *[f"--config.{o}" for o in SMALL])
    assert first.returncode == 0, first.stderr
    resumed = command("transformer.train", "--workdir", workdir, "--config.train.steps=4")
    assert resumed.returncode == 0, resumed.stderr
    assert "steps 2->4" in resumed.stderr
    steps = [json.loads(line)["step"] for line in open(os.path.join(workdir, "metrics.jsonl"))]
    assert max(steps) == 4
    assert json.load(open(os.path.join(workdir, "config.json")))["train"]["steps"] == 4


def test_a_resumed_run_takes_overrides_of_how_it_computes(tmp_path):
    config = rundir.resumed_config(saved_run(tmp_path), {"train.steps": "3000", "model.remat": "full"})
    assert config.train.steps == 3000 and config.model.remat == "full" and config.model.num_layers == 4


def test_a_resumed_run_refuses_another_model_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"config.model.num_layers=2: the run in .* has model.num_layers=4"):
        rundir.resumed_config(saved_run(tmp_path), {"model.num_layers": "2"})


def test_a_resumed_run_names_the_nearest_key(tmp_path):
    with pytest.raises(KeyError, match="unknown config key train.stepz; did you mean train.steps"):
        rundir.resumed_config(saved_run(tmp_path), {"train.stepz": "4"})


def test_without_config_an_empty_workdir_asks_for_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="pass --config"):
        rundir.resumed_config(str(tmp_path), {})


POST_TRAINING = ("sft.py", "dpo.py", "grpo.py")  # config files of a saved run (config.init_from)


def config_specs(tmp_path) -> list[str]:
    """Every config file of configs/ (the post-training ones of a saved run), and the presets and tasks whose
    keys differ."""
    files = sorted(os.path.basename(path) for path in glob.glob(os.path.join(REPO, "configs", "*.py")))
    run = saved_run(tmp_path)
    specs = [f"configs/{name}:init_from={run}" if name in POST_TRAINING else f"configs/{name}" for name in files]
    tasks = [f"configs/bert.py:tiny,task={task}" for task in ("sequence_classification", "token_classification")]
    return specs + tasks + ["configs/vit.py:s16"]


def test_every_key_of_every_config_has_a_default_and_a_meaning(tmp_path):
    listed = set()
    for spec in config_specs(tmp_path):
        path = spec.partition(":")[0]
        config, base = config_lib.load_with_base(spec)
        rows = config_keys.rows(config, base, path)
        assert {row[0] for row in rows} == set(config_lib.leaves(config)), spec
        assert [row[0] for row in rows if not row[3]] == [], f"{spec}: keys without a line in config_keys.MEANINGS"
        assert [row[0] for row in rows if not row[2]] == [], f"{spec}: keys without a default"
        listed |= {row[0] for row in rows}
    tables = [config_keys.MEANINGS, *config_keys.OWN.values()]
    assert sorted({key for table in tables for key in table} - listed) == [], "meanings of keys no config has"


def test_the_key_listing_marks_a_changed_value():
    config, base = config_lib.load_with_base("configs/gpt.py:optim.lr=0.5")
    lr = next(row for row in config_keys.rows(config, base, "configs/gpt.py") if row[0] == "optim.lr")
    assert lr[1] == "0.5*" and lr[3].startswith("peak learning rate")


def test_a_family_and_a_config_file_have_their_own_meanings():
    assert config_keys.meaning("model.head", "vit") == "classifier (logits) | none (the hidden states)"
    assert config_keys.meaning("data.seq_len", "gpt", "configs/sft.py") == "tokens of a packed row"
    assert config_keys.meaning("data.seq_len", "gpt", "configs/gpt.py") == "tokens of each training row"
    mine = config_keys.meaning("data.tokenizer", "gpt", "experiments/mine.py")
    assert mine.endswith("wordpiece (trained) | gpt2 | hf")


def test_inspect_lists_the_keys_with_their_meanings():
    result = command("transformer.inspect", "--config", "configs/gpt.py:tiny", "--config.train.steps=7", "--keys")
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("train.steps "))
    assert line.split()[1:3] == ["7*", "100000"] and "optimizer steps" in line


@pytest.mark.parametrize("spec, flag", [("configs/gpt.py:tiny,optim.learning_rate=1", None),
                                        ("configs/gpt.py:tiny", "--config.optim.learning_rate=1")])
def test_a_misspelt_key_names_the_nearest(spec, flag):
    result = command("transformer.inspect", "--config", spec, *([flag] if flag else []))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == \
        "error: in --config: unknown config key optim.learning_rate; did you mean optim.lr?"


def test_nearest_reads_initials_and_spellings():
    known = config_lib.leaves(config_lib.load("configs/vit.py:tiny"))
    assert config_lib.nearest("optim.learning_rate", known) == "optim.lr"
    assert config_lib.nearest("model.num_layer", known) == "model.num_layers"
    assert config_lib.nearest("data.augment.flipp", known) == "data.augment.flip"


def test_train_help_says_how_to_list_and_override_keys():
    result = command("transformer.train", "--help")
    assert "--config:" in result.stdout and "--config.train.steps=200" in result.stdout
    assert "python -m transformer.inspect --config configs/gpt.py:tiny --keys" in " ".join(result.stdout.split())
