"""Tests of `python -m transformer.inspect` and its library (models/summary.py): pinned parameter counts,
kinds, FLOPs and the CLI."""

import os
import subprocess
import sys

import pytest

from transformer import config as config_lib
from transformer.models import summary
from transformer.training import shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(arg: str, *overrides: str):
    """The config with the keys it leaves to the data filled in (a published preset's vocabulary is its own)."""
    return shapes.resolved(config_lib.load(os.path.join(ROOT, f"configs/gpt.py:{arg}"), overrides))


@pytest.fixture(scope="module")
def gpt3():
    return summary.summarize(load("gpt3-175b"))


@pytest.mark.slow
def test_gpt3_175b_rows(gpt3):
    rows = {r.kind: r for r in gpt3["rows"]}
    expected = {
        "embedding": 617_558_016, "unembedding": 617_558_016,
        "query": 14_495_514_624, "key": 14_495_514_624, "value": 14_495_514_624, "output": 14_495_514_624,
        "mlp up": 57_982_058_496, "mlp down": 57_982_058_496,
    }
    assert {kind: rows[kind].parameters for kind in expected} == expected
    assert rows["query"].shape == (12288, 96, 128) and rows["query"].count == 96
    assert rows["query"].axes == ("embed", "heads", "head_dim")
    assert rows["norm scale"].count == 2 * 96 + 1
    assert "mlp gate" not in rows and len(rows) == len(gpt3["rows"])  # one row per kind


def test_gpt3_175b_totals(gpt3):
    assert gpt3["matrices"] == 175_181_291_520
    assert gpt3["total"] == 175_221_817_344
    assert gpt3["matmul"] == 175_181_291_520 - 617_558_016  # untied: the embedding is a lookup
    assert gpt3["forward_flops"] == 2 * gpt3["matmul"] + 4 * 96 * 2048 * 12288
    assert gpt3["training_flops"] == 3 * gpt3["forward_flops"]
    assert gpt3["param_gib"] == pytest.approx(175_221_817_344 * 4 / 2**30)
    assert gpt3["training_state_gib"] == pytest.approx(3 * gpt3["param_gib"])


def test_gpt2_small_total_and_tied_matmul():
    table = summary.summarize(load("gpt2-small"))
    assert table["total"] == 124_439_808
    assert "unembedding" not in {r.kind for r in table["rows"]}
    assert table["matmul"] == table["matrices"]  # tied: the embedding is the output projection


def test_overrides_and_bfloat16_params():
    table = summary.summarize(load("tiny", "model.num_layers=2", "model.activation=swiglu",
                                   "model.d_model=256", "model.mlp_dim=1024", "model.param_dtype=bfloat16"))
    rows = {r.kind: r for r in table["rows"]}
    assert rows["mlp gate"].count == 2 and rows["mlp gate"].shape == (256, 1024)
    assert table["param_gib"] == pytest.approx(table["total"] * 2 / 2**30)


@pytest.mark.parametrize("path, kind", [
    (("block_7", "self_attn", "query", "kernel"), "query"),
    (("final_norm", "scale"), "norm scale"),
    (("block_0", "cross_attn", "out", "bias"), "cross-attention output bias"),
    (("head", "w"), "head/w"),
])
def test_kind_of(path, kind):
    assert summary.kind_of(path)[1] == kind


@pytest.mark.parametrize("arg, tokenizer, vocab_size", [
    ("gpt2-xl", "gpt2", 50257), ("gpt3-175b", "gpt2", 50257), ("llama3-8b", "hf", 128256),
    ("mistral-7b", "hf", 32000), ("mixtral-8x7b", "hf", 32000), ("qwen3-30b-a3b", "hf", 151936),
    ("tiny", "", 0), ("llama-tiny", "", 0),                        # generic sizes: the data's
    ("gpt2-small,data.tokenizer=bpe", "bpe", 0),                   # another tokenizer: the data's ids
    ("gpt2-small,data.tokenizer=bpe,model.vocab_size=50304", "bpe", 50304),
])
def test_published_presets_keep_their_tokenizer_and_vocabulary(arg, tokenizer, vocab_size):
    config = config_lib.load(os.path.join(ROOT, f"configs/gpt.py:{arg}"))
    assert (config.data.tokenizer, config.model.vocab_size) == (tokenizer, vocab_size)


def test_a_published_preset_on_a_token_store_takes_the_stores_tokenizer(tmp_path):
    import types

    from transformer.data.text import store_build

    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n" * 50)
    fields = dict(source=str(tmp_path / "text.txt"), eval_source="", text_field="text", tokenizer="byte",
                  tokenizer_path="", vocab_size=0, sample_mb=1.0, eval_fraction=0.2, shard_mb=1.0)
    store_build.build(store_build.settings_of(types.SimpleNamespace(**fields)), str(tmp_path / "store"), 0,
                      progress=False)
    config = load(f"gpt2-small,data.source={tmp_path / 'store'}")
    assert (config.data.tokenizer, config.model.vocab_size) == ("byte", 256)


@pytest.mark.slow
def test_cli_prints_the_published_table():
    result = subprocess.run(
        [sys.executable, "-m", "transformer.inspect", "--config", "configs/gpt.py:gpt3-175b"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "617,558,016" in result.stdout
    assert "14,495,514,624" in result.stdout
    assert "175,181,291,520" in result.stdout
    assert "from the data" not in result.stderr
