"""A run opened once: the run directory answers a consumer's every question (its config, upgraded; its chat
format or none; its stop ids; one tokenizer object; its params restored onto a target), and no other module
asks the files themselves."""

import ast
import glob
import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from transformer import config as config_lib
from transformer import rundir
from transformer.data.text import chat_templates, tokenizers
from transformer.training.tasks import sft

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model.num_layers=1", "model.d_model=16", "model.num_heads=2", "model.mlp_dim=32", "model.max_len=16",
        "model.vocab_size=256"]


def _run(tmp_path, chat: bool, drop: tuple[str, ...] = ()):
    """A tiny GPT run directory with a byte tokenizer (and the built-in chat format where `chat`), its
    config.json written without the keys `drop` names (SECTION.KEY), as a run from before they existed."""
    config = config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny"), TINY)
    path = str(tmp_path / "run")
    os.makedirs(path)
    saved = json.loads(config.to_json())
    for key in drop:
        section, name = key.split(".")
        del saved[section][name]
    with open(os.path.join(path, rundir.CONFIG), "w") as f:
        json.dump(saved, f)
    tokenizer = tokenizers.ByteTokenizer()
    tokenizer.save(path)
    if chat:
        chat_templates.built_in(tokenizer).save(path)
    return path


def test_a_plain_run_has_no_chat_format_and_stops_at_its_end_of_document(tmp_path):
    run = rundir.open(_run(tmp_path, chat=False))
    assert run.chat_format() is None
    assert run.stop_ids() == run.stop_ids(chat=False) == (0xFF,)
    with pytest.raises(FileNotFoundError, match="is not a chat model; fine-tune it with --config configs/sft.py"):
        run.chat_format(required=True)


def test_a_chat_run_answers_its_format_stop_ids_and_one_tokenizer(tmp_path):
    run = rundir.open(_run(tmp_path, chat=True))
    chat = run.chat_format()
    assert chat is run.chat_format(required=True) and chat.tokenizer is run.tokenizer(framed=False)
    assert run.tokenizer() is run.tokenizer()
    assert run.stop_ids() == chat.end_ids == (256 + chat_templates.BUILT_IN_MARKERS.index(chat_templates.END),)
    assert run.stop_ids(chat=False) == (0xFF,)  # plain text ends where a document does
    assert sft.pretrained_chat(run.path).end_ids == chat.end_ids


def test_an_old_config_is_read_upgraded_by_every_reader(tmp_path):
    path = _run(tmp_path, chat=False, drop=("model.remat", "train.keep_checkpoints"))
    assert "remat" not in json.load(open(os.path.join(path, rundir.CONFIG)))["model"]
    run = rundir.open(path)
    assert "remat" in run.config.model and "keep_checkpoints" in run.config.train
    assert "remat" in rundir.starting_model(path, "configs/sft.py")
    with pytest.raises(FileNotFoundError, match="init_from=.*: no .*config.json"):
        rundir.starting_model(str(tmp_path / "nothing"), "configs/sft.py")


def test_params_restore_onto_a_target_laid_out_and_placed_as_it(tmp_path):
    run = rundir.open(_run(tmp_path, chat=False))
    model = run.model()
    params = nn.unbox(model.init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"])
    ckpt = run.checkpointer()
    ckpt.save_params(params)
    ckpt.wait()
    ckpt.close()
    target = jax.tree.map(lambda p: p + 1, params)
    restored = rundir.open(run.path).restore_onto(target)
    for saved, got, want in zip(*(jax.tree.leaves(t) for t in (params, restored, target))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))
        assert got.sharding == want.sharding
    shapes = jax.eval_shape(lambda: target)
    unplaced = rundir.open(run.path).restore_onto(shapes, place=False)
    assert jax.tree.structure(unplaced) == jax.tree.structure(params)


def _modules() -> list[str]:
    return glob.glob(os.path.join(REPO, "transformer", "**", "*.py"), recursive=True)


def _code_constants(tree) -> list:
    """The string constants of a module's code (docstrings left out)."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docs]


def test_only_the_run_directory_opens_a_runs_files():
    """A run's config.json (read through `read_config`, which upgrades it), its chat format and its params are
    read in rundir.py alone (interop/'s Hugging Face modules read those directories' own config.json)."""
    found = []
    for path in _modules():
        name = os.path.relpath(path, REPO)
        if name == "transformer/rundir.py":
            continue
        source = open(path).read()
        tree = ast.parse(source)
        hf = name.startswith("transformer/interop/") and name != "transformer/interop/adapters.py"
        if "config.json" in _code_constants(tree) and not hf:
            found.append(f"{name}: 'config.json'")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("from_json", "from_saved", "FILE") and \
                    name != "transformer/data/text/chat_templates.py":
                if node.attr != "FILE" or ast.unparse(node.value).endswith("chat_templates"):
                    found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def _module_aliases(tree) -> dict[str, str]:
    """The names a module binds to modules of this package (alias -> its file)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformer"):
            base = os.path.join(REPO, *node.module.split("."))
            for a in node.names:
                if os.path.isfile(os.path.join(base, a.name + ".py")) or os.path.isdir(os.path.join(base, a.name)):
                    aliases[a.asname or a.name] = os.path.join(base, a.name)
    return aliases


def test_no_module_uses_another_modules_private_names():
    """A helper another module imports is public (STYLE.md): no `from M import _x`, no `m._x` of a module m."""
    found = []
    for path in _modules():
        name = os.path.relpath(path, REPO)
        tree = ast.parse(open(path).read())
        aliases = _module_aliases(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformer"):
                found += [f"{name}: from {node.module} import {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []

