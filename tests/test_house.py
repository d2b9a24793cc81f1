"""The house rules: family knowledge stays in models/, every task keeps the Task contract, a config
mistake costs one line (exit code 2) and no work, and one FLOPs formula serves inspect, bench and
the loop's train/mfu."""

import ast
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import types

import jax
import pytest
from conftest import FAST_COMPILES

from transformer import config as config_lib
from transformer import models, sharding
from transformer.bench import measure
from transformer.models import summary
from transformer.models.flops import forward_flops
from transformer.training import checks, loop, mfu, shapes, tasks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILY_KNOWLEDGE = ("transformer/models/", "transformer/interop/hf_families.py")


def _family_comparisons(path: str) -> list[str]:
    """Comparisons (==, !=, in, not in) of a family name, or of something called `family`, in a file."""
    names = set(models.families())
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        constants = [e for o in operands for e in (o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [o])]
        named = any(isinstance(c, ast.Constant) and c.value in names for c in constants)
        family = any(isinstance(o, ast.Attribute) and o.attr == "family" or isinstance(o, ast.Name) and o.id == "family"
                     for o in operands)
        if named or family:
            found.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
    return found


def test_no_module_outside_models_compares_a_family_name(tmp_path):
    files = [p for p in glob.glob(os.path.join(REPO, "transformer", "**", "*.py"), recursive=True)
             if not os.path.relpath(p, REPO).startswith(FAMILY_KNOWLEDGE)]
    assert len(files) > 20
    assert [hit for path in files for hit in _family_comparisons(path)] == []
    planted = tmp_path / "leak.py"  # the scan finds them where they are
    planted.write_text("if config.model.family == 'gpt':\n    pass\nok = name in ('vit', 'bert')\n")
    assert len(_family_comparisons(str(planted))) == 2


def _training_imports(path: str, package: str) -> list[str]:
    """The imports of transformer.training (or anything in it) in a file of `package`, relative ones resolved."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else [])
            base = ".".join(filter(None, (base, node.module)))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        if any(name == "transformer.training" or name.startswith("transformer.training.") for name in names):
            found.append(f"{os.path.basename(path)}:{node.lineno}")
    return found


def test_models_import_nothing_from_training(tmp_path):
    files = glob.glob(os.path.join(REPO, "transformer", "models", "**", "*.py"), recursive=True)
    assert len(files) >= 5
    assert [hit for path in files for hit in _training_imports(path, "transformer.models")] == []
    planted = tmp_path / "leak.py"  # the scan finds them where they are
    planted.write_text("import transformer.training.tasks.lm\nfrom transformer.training import losses\n"
                       "from transformer import training\nfrom ..training.losses import mean\n"
                       "from transformer.layers import cross_entropy\nfrom . import common\n")
    assert _training_imports(str(planted), "transformer.models") == [f"leak.py:{i}" for i in (1, 2, 3, 4)]


def test_every_task_keeps_the_contract():
    for name in tasks.TASKS:
        module = tasks.module(name)
        assert callable(module.check) and callable(module.from_data) and callable(module.build)
    for name, cls in [("lm", "LMTask"), ("mlm", "MLMTask"), ("image_classification", "ImageClassificationTask"),
                      ("seq2seq", "Seq2SeqTask"), ("sequence_classification", "SequenceClassificationTask"),
                      ("token_classification", "TokenClassificationTask")]:
        task_class = getattr(tasks.module(name), cls)
        missing = [m for m in tasks.MEMBERS if m != "items_per_step" and not hasattr(task_class, m)]
        assert missing == [], f"{cls} lacks {missing}"


def test_the_shapes_mechanism_names_no_task():
    """What a task takes from its data is its module's `from_data`: shapes.py dispatches, never compares."""
    text = open(os.path.join(REPO, "transformer", "training", "shapes.py")).read()
    assert [name for name in tasks.TASKS if f'"{name}"' in text] == []


def test_a_launch_checks_its_config_once_and_reads_a_classifiers_train_file_once(tmp_path, monkeypatch):
    """`python -m transformer.train` (its main, in this process) on a BERT classifier whose labels and
    shapes come from its train file: one validation, one read of that file, before and for the batches."""
    import builtins

    from test_bert import SMALL_BERT, write_moods

    from transformer import train
    for split, seed in (("train", 0), ("eval", 1)):
        write_moods(tmp_path / f"{split}.tsv", 24, seed)
    config = config_lib.load(os.path.join(REPO, "configs/bert.py:tiny,task=sequence_classification"), [
        *SMALL_BERT, "model.num_labels=0", "train.steps=2", f"data.train_path={tmp_path / 'train.tsv'}",
        f"data.eval_path={tmp_path / 'eval.tsv'}"])
    validations, reads, real_validate, real_open = [], [], checks.validate, builtins.open
    monkeypatch.setattr(checks, "validate", lambda c: validations.append(c) or real_validate(c))

    def counting_open(file, *args, **kwargs):
        if os.path.basename(str(file)) == "train.tsv":
            reads.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(train.flags, "FLAGS", types.SimpleNamespace(
        config=config, workdir=str(tmp_path / "run"), coordinator=None, num_processes=None, process_id=None,
        distributed=False, resume_step=None))
    train.main(["train"])
    assert (len(validations), len(reads)) == (1, 1)
    assert json.load(real_open(tmp_path / "run" / "labels.json")) == ["neg", "neu", "pos"]


def test_a_run_saved_before_keys_existed_reads_with_their_defaults(tmp_path):
    """rundir.read_config upgrades an older config.json in one place: the loop, checks and resume read every key."""
    from transformer import rundir
    config = config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny"), ["model.vocab_size=256", "data.tokenizer=byte"])
    old = config.to_dict()
    for section, key in (("train", "router_bias_rate"), ("train", "load_balance_weight"), ("optim", "lion_b2"),
                         ("model", "num_experts"), ("model", "router")):
        del old[section][key]
    (tmp_path / "config.json").write_text(json.dumps(old))
    saved = rundir.open(str(tmp_path)).config
    assert (saved.train.router_bias_rate, saved.train.load_balance_weight, saved.optim.lion_b2) == (0.0, 0.01, 0.99)
    assert (saved.model.num_experts, saved.model.router) == (0, "softmax")
    assert checks.validate(rundir.resumed_config(str(tmp_path), {"train.steps": "5"})) == "lm"


def test_every_family_names_its_task_and_cost_for_every_preset():
    """Each preset at two layers: the layers repeat, and the largest presets would take minutes to trace."""
    for name, family in models.families().items():
        config = config_lib.load(os.path.join(REPO, f"configs/{name}.py"))
        for preset in family.presets:
            config.unlock()
            config.model = family.model_config(preset)
            config.model.num_layers = min(config.model.num_layers, 2)
            if config.model.get("num_decoder_layers"):
                config.model.num_decoder_layers = min(config.model.num_decoder_layers, 2)
            if config.model.get("dense_layers"):
                config.model.dense_layers = [i for i in config.model.dense_layers if i < 2]
            flops = forward_flops(config)
            assert flops["per_token"] > 0 and flops["tokens"] > 0 and flops["matmul"] > 0, (name, preset)
            assert models.task_of(config.model) in tasks.TASKS


@pytest.mark.parametrize("preset", ["tiny", "gpt2-small"])
def test_gpt_flops_are_palms(preset):
    """For a decoder the formula is PaLM's 2N + 4 L T D per token (N: matrices less lookups)."""
    config = shapes.resolved(config_lib.load(os.path.join(REPO, f"configs/gpt.py:{preset}")))
    m, t = config.model, config.data.seq_len
    flops = forward_flops(config)
    table = summary.summarize(config)
    lookup = 0 if m.tie_embeddings else m.vocab_size * m.d_model
    assert flops["matmul"] == table["matrices"] - lookup
    assert flops["per_token"] == 2 * flops["matmul"] + 4 * m.num_layers * m.d_model * t


def run_cli(module: str, *args: str, cwd: str = REPO, env_extra: dict | None = None):
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILES}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("spec, flags, key", [
    ("configs/gpt.py:tiny,model.activation=gleu", [], "config.model.activation"),
    ("configs/vit.py:tiny,model.norm=batchnorm", [], "config.model.norm"),
    ("configs/gpt.py:tiny", ["--config.model.vocab_size=100", "--config.data.tokenizer=bpe"],
     "config.model.vocab_size"),
    ("configs/bert.py:tiny", ["--config.model.head=none"], "config.model.head"),
    ("configs/encdec.py:tiny", ["--config.data.target_len=999"], "config.data.target_len"),
    ("configs/gpt.py:tiny", ["--config.optim.schedule=step"], "config.optim.schedule"),
])
def test_a_config_mistake_is_one_line_and_no_work(tmp_path, spec, flags, key):
    workdir = tmp_path / "run"
    result = run_cli("transformer.train", "--config", spec, "--workdir", str(workdir), *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], result.stderr
    assert not workdir.exists()  # no config, tokenizer, data_cache: nothing was done


def test_mesh_rules_name_every_logical_axis(small_gpt_config):
    config = small_gpt_config()
    config.mesh.rules = [rule for rule in config.mesh.rules if rule[0] != sharding.HEAD_DIM]
    with pytest.raises(ValueError, match="config.mesh.rules: no rule for the logical axes head_dim"):
        checks.validate(config)
    config.mesh.rules = [*config.mesh.rules, ["kv", None]]  # a config from before the rename
    with pytest.raises(ValueError, match="'kv' is now called 'head_dim'"):
        checks.validate(config)


def test_train_mfu_cannot_exceed_one_the_peak_rises_to_a_faster_interval_and_says_so(
        small_gpt_config, tmp_path, monkeypatch, capsys):
    utilisation = mfu.Utilisation(flops_per_step=100.0, peak=1000.0)
    assert utilisation(steps=2, seconds=1.0) == (0.2, None)
    value, note = utilisation(steps=30, seconds=1.0)  # 3000 FLOP/s: above the peak
    assert value == 1.0 and "above the peak" in note and utilisation.peak == 3000.0
    assert utilisation(steps=15, seconds=1.0) == (0.5, None)
    monkeypatch.setattr(mfu, "device_peak", lambda dtype: (1.0, "a peak of 1 FLOP/s"))
    config = small_gpt_config("train.steps=4", "train.log_every=2", "train.eval_every=4")
    loop.train(config, str(tmp_path / "run"), devices=jax.devices()[:1])
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    logged = [r["train/mfu"] for r in records if "train/mfu" in r]
    assert len(logged) == 2 and logged[0] == 1.0 and all(0 < value <= 1.0 for value in logged)
    assert "train/mfu: steps ran at" in capsys.readouterr().err


def test_a_measured_peak_is_measured_once_per_machine_and_then_read(tmp_path, monkeypatch):
    monkeypatch.setenv("TRANSFORMER_CACHE", str(tmp_path))
    timed = []
    monkeypatch.setattr(mfu, "measured_matmul_peak", lambda dtype: timed.append(dtype) or 5e9)
    assert mfu.kept_matmul_peak("cpu", "float32") == 5e9 and mfu.kept_matmul_peak("cpu", "float32") == 5e9
    assert mfu.kept_matmul_peak("cpu", "bfloat16") == 5e9 and timed == ["float32", "bfloat16"]
    (tmp_path / "peaks.json").write_text("not json")
    assert mfu.kept_matmul_peak("cpu", "float32") == 5e9 and len(timed) == 3


def test_train_mfu_is_inspects_flops_times_tokens_over_the_peak(small_gpt_config, tmp_path):
    config = small_gpt_config("train.steps=4", "train.log_every=2", "train.eval_every=4")
    loop.train(config, str(tmp_path / "run"), devices=jax.devices()[:1])
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    per_token = forward_flops(config)["per_token"]
    peak, _ = mfu.device_peak(config.model.dtype)
    logged = [r for r in records if "train/mfu" in r]
    assert len(logged) == 2
    for r in logged:  # against the peak, raised to any faster interval
        achieved = 3 * per_token * r["train/tokens_per_s"]
        peak = max(peak, achieved)
        assert r["train/mfu"] == pytest.approx(achieved / peak, rel=1e-6)
    printed = run_cli("transformer.inspect", "--config", "configs/gpt.py:tiny", *[f"--config.{o}" for o in
                      ("model.num_layers=2", "model.d_model=32", "model.num_heads=4", "model.mlp_dim=64",
                       "model.max_len=32", "data.seq_len=16")])
    assert printed.returncode == 0, printed.stderr
    assert f"{per_token:,}" in printed.stdout and f"{3 * per_token:,}" in printed.stdout


def test_bench_uses_the_same_formula(small_gpt_config, capsys):
    config = small_gpt_config()
    args = types.SimpleNamespace(steps=1, warmup=1, rounds=1, hf_eager=True, hf_threads=0)
    result = measure.bench_train(config, args, theirs_too=False)
    tokens = forward_flops(config)["tokens"] * config.data.batch_size
    expected = 3 * forward_flops(config)["per_token"] * tokens / result["step_s"]
    assert math.isclose(result["flops_per_s"], expected, rel_tol=1e-9)


TOY_MODEL = '''
"""Toy: a bag-of-previous-token language model, registered by this file alone (a test's)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.models import common


class Toy(nn.Module):
    vocab_size: int = 256
    d_model: int = 16
    max_len: int = 64
    dtype: str = "float32"
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, tokens, deterministic=True):
        x = nn.Embed(self.vocab_size, self.d_model, name="embed")(tokens)
        return nn.Dense(self.vocab_size, name="out")(jnp.tanh(nn.Dense(self.d_model, name="mix")(x)))


def cost(model, config):
    length = config.data.seq_len
    return common.Cost(tokens=length, weight_tokens=lambda path: 0 if path[0] == "embed" else length,
                       attention=(), context=f"L = {length}")


FAMILY = common.Family(
    name="toy", module=Toy, presets={"tiny": {}},
    example_inputs=lambda model: (jax.ShapeDtypeStruct((1, 1), jnp.int32),),
    validate=lambda model: None, task=lambda model: "lm", cost=cost,
    no_generation="toy models do not generate (a test family)",
)
'''

TOY_CONFIG = '''
import ml_collections

from transformer import config as config_lib
from transformer.models import toy


def get_config(arg=None):
    preset, overrides = config_lib.parse_arg(arg, default_preset="tiny")
    c = ml_collections.ConfigDict()
    c.model = toy.FAMILY.model_config(preset)
    c.data = dict(source="stdlib", text_field="text", tokenizer="byte", vocab_size=0, tokenizer_path="",
                  seq_len=16, batch_size=8, eval_fraction=0.02, eval_batches=2, eval_source="", document_mask=False)
    c.optim = config_lib.optim_config(lr=1e-2, warmup_steps=1)
    c.train = config_lib.train_config(steps=4, log_every=2, eval_every=4, checkpoint_every=4)
    return config_lib.finish(c, {}, overrides)
'''


@pytest.mark.slow
def test_a_toy_family_is_files_in_models_and_configs_only(tmp_path):
    """Copy the package, add models/toy.py and configs/toy.py: train, inspect, bench and generate
    (its one-line refusal) work on it with no other change."""
    root = tmp_path / "repo"
    shutil.copytree(os.path.join(REPO, "transformer"), root / "transformer",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(REPO, "configs"), root / "configs", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "transformer" / "models" / "toy.py").write_text(textwrap.dedent(TOY_MODEL))
    (root / "configs" / "toy.py").write_text(textwrap.dedent(TOY_CONFIG))
    run = lambda *args: run_cli(*args, cwd=str(root))

    trained = run("transformer.train", "--config", "configs/toy.py", "--workdir", "runs/toy")
    assert trained.returncode == 0, trained.stderr[-3000:]
    last = {}
    for line in open(root / "runs" / "toy" / "metrics.jsonl"):
        last.update(json.loads(line))
    assert last["step"] == 4 and math.isfinite(last["eval/loss"]) and last["train/mfu"] > 0
    assert last["train/loss"] < math.log(256)

    inspected = run("transformer.inspect", "--config", "configs/toy.py")
    assert inspected.returncode == 0 and "forward FLOPs per token (L = 16)" in inspected.stdout, inspected.stderr

    benched = run("transformer.bench", "--config", "configs/toy.py", "--steps", "1", "--warmup", "1",
                  "--mode", "all")
    assert benched.returncode == 0, benched.stderr[-3000:]
    assert "MFU" in benched.stdout and "generate: skipped" in benched.stdout

    refused = run("transformer.generate", "--workdir", "runs/toy", "--prompt", "def ")
    assert refused.returncode == 2 and refused.stderr.strip() == "error: toy models do not generate (a test family)"
