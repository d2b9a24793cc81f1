"""What a user's inputs meet before any work and at the edges: every documented data source through a whole
launch with the dtypes real files have, an empty corpus, sizes and flags out of range, a long line, the lines
that say what was read, and a finished run launched again."""

import gzip
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
from absl import flags
from conftest import FAST_COMPILES, REPO, SMALL_GPT
from PIL import Image

from transformer import config as config_lib
from transformer import generate, rundir
from transformer.data.text import sources, store_build, store_encoding, tokenizers
from transformer.data.text import token_store as store
from transformer.training import checks, evaluation, loop, shapes
from transformer.training.tasks import lm

GPT_RUN = [*SMALL_GPT, "train.steps=2", "train.eval_every=2", "train.checkpoint_every=2", "data.eval_fraction=0.3"]
VIT_RUN = ["model.num_layers=1", "model.d_model=16", "model.num_heads=2", "model.mlp_dim=32", "data.batch_size=8",
           "data.workers=0", "train.steps=2", "train.log_every=1", "train.eval_every=2",
           "train.checkpoint_every=2"]


def settings(source: str, tokenizer: str = "byte", **kw) -> dict:
    f = types.SimpleNamespace(source=source, eval_source="", text_field="text", tokenizer=tokenizer, tokenizer_path="",
                              vocab_size=kw.get("vocab_size", 300), sample_mb=32.0,
                              eval_fraction=kw.get("eval_fraction", 0.3), shard_mb=16.0)
    return store_build.settings_of(f)


def texts_of(pattern: str) -> list[str]:
    return [text for _, text in sources.read_documents(sources.resolve_files(pattern))]


def write_idx(path, array: np.ndarray) -> None:
    """An MNIST-family IDX file of a uint8 array (gzipped where `path` ends in .gz)."""
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    data = header + array.astype(np.uint8).tobytes()
    with (gzip.open if str(path).endswith(".gz") else open)(path, "wb") as f:
        f.write(data)


def image_source(kind: str, root) -> str:
    """A source of 48 grayscale 8 x 8 uint8 images with uint8 labels 0..2, as real files hold them."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (48, 8, 8), dtype=np.uint8)
    y = (np.arange(48) % 3).astype(np.uint8)
    if kind == "digits":
        return "digits"
    if kind == "npz":
        np.savez(root / "images.npz", x=x, y=y)
        return str(root / "images.npz")
    if kind == "idx":
        os.makedirs(root / "idx")
        write_idx(root / "idx" / "train-images-idx3-ubyte.gz", x[:40])
        write_idx(root / "idx" / "train-labels-idx1-ubyte.gz", y[:40])
        write_idx(root / "idx" / "t10k-images-idx3-ubyte", x[40:])
        write_idx(root / "idx" / "t10k-labels-idx1-ubyte", y[40:])
        return str(root / "idx")
    for i in range(len(x)):
        os.makedirs(root / "folder" / f"class_{y[i]}", exist_ok=True)
        Image.fromarray(x[i]).save(root / "folder" / f"class_{y[i]}" / f"{i:03d}.png")
    return str(root / "folder")


def text_source(kind: str, root, corpus: str) -> str:
    """The corpus fixture's documents as text files, JSON lines, Parquet or a token store."""
    if kind == "text":
        return corpus
    if kind == "jsonl":
        with open(root / "docs.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts_of(corpus))
        return str(root / "docs.jsonl")
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts_of(corpus)}), root / "docs.parquet")
        return str(root / "docs.parquet")
    store_build.build(settings(corpus), str(root / "store"), 0, progress=False)
    return str(root / "store")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["digits", "npz", "idx", "folder", "text", "jsonl", "parquet", "store"])
def test_every_documented_source_goes_through_a_whole_launch(tmp_path, corpus, kind):
    if kind in ("digits", "npz", "idx", "folder"):
        source = image_source(kind, tmp_path)
        config = config_lib.load(os.path.join(REPO, "configs/vit.py:tiny"), [*VIT_RUN, f"data.source={source}"])
    else:
        source = text_source(kind, tmp_path, corpus)
        config = config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny"), [*GPT_RUN, f"data.source={source}"])
    last = loop.train(config, str(tmp_path / "run"))
    assert np.isfinite(last["eval/loss"]) and rundir.open(str(tmp_path / "run")).latest_step == 2
    if kind in ("npz", "idx", "folder"):
        assert rundir.open(str(tmp_path / "run")).config.model.num_classes == 3


def test_an_empty_corpus_fails_in_one_line_and_leaves_no_store(tmp_path, small_gpt_config):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(ValueError, match=r"holds no text \(0 bytes\)"):
        store_build.build(settings(str(tmp_path / "empty" / "*.txt")), str(tmp_path / "st"), 0, progress=False)
    assert not (tmp_path / "st").exists()

    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": ""}\n')  # bytes, but no document text
    out = subprocess.run([sys.executable, "-m", "transformer.data.tokenize", "--source", str(tmp_path / "blank.jsonl"),
                          "--out", str(tmp_path / "st2"), "--workers", "0"], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 2 and out.stderr.splitlines()[-1].startswith("error: ") and "holds no text" in out.stderr
    assert not (tmp_path / "st2").exists()

    with pytest.raises(ValueError, match="holds no text"):  # a run's own tokenization
        loop.train(small_gpt_config(f"data.source={tmp_path / 'blank.jsonl'}"), str(tmp_path / "run"))
    assert not (tmp_path / "run" / "store").exists()


@pytest.mark.parametrize("spec, override, message", [
    ("gpt.py:tiny", "data.seq_len=-1", r"config.data.seq_len=-1 must be at least 1"),
    ("gpt.py:tiny", "data.seq_len=0", r"config.data.seq_len=0 must be at least 1"),
    ("gpt.py:tiny", "data.eval_batches=0", r"config.data.eval_batches=0 must be at least 1"),
    ("gpt.py:tiny", "model.d_model=0", r"config.model.d_model=0 must be at least 1"),
    ("encdec.py:tiny", "data.target_len=0", r"config.data.target_len=0 must be at least 1"),
    ("bert.py:tiny", "data.seq_len=-4", r"config.data.seq_len=-4 must be at least 1"),
])
def test_sizes_that_are_not_positive_fail_naming_the_key(spec, override, message):
    with pytest.raises(ValueError, match=message):
        checks.validate(config_lib.load(os.path.join(REPO, "configs", spec), [override]))


def test_a_batch_larger_than_memory_fails_before_any_data_is_read(tmp_path, small_gpt_config):
    config = small_gpt_config("data.batch_size=100000000", f"data.source={tmp_path / 'nothing-read' / '*.txt'}")
    with pytest.raises(ValueError, match=r"^config.data.batch_size=100000000: one layer's activations .* more than "
                                         r"the .* GiB of this host's memory: lower it, or raise config.optim"):
        loop.prepare(config)
    loop.prepare(small_gpt_config())  # the small batch passes


def test_a_step_past_a_cpus_share_of_the_host_fails_in_one_line_before_any_step(tmp_path, small_gpt_config,
                                                                                monkeypatch):
    """A batch within the quick bound whose compiled step needs more than a CPU device's share of the host's
    memory (here a host of 8 MiB: 1 MiB for each of the 8 devices) stops before any step, naming the batch."""
    import jax

    from transformer.training import memory
    (tmp_path / "text.txt").write_text("some text to tokenize. " * 50)
    config = small_gpt_config(f"data.source={tmp_path / 'text.txt'}", "train.sample_tokens=0")
    monkeypatch.setattr(memory, "host_bytes", lambda: 8 * 2**20)
    assert memory.available(0, jax.devices()[0]) == 2**20
    with pytest.raises(memory.DoesNotFit, match=r"^the train step does not fit in the device's .* a smaller "
                                                r"data.batch_size"):
        loop.train(config, str(tmp_path / "run"), jax.devices()[:1])
    assert not os.path.isdir(tmp_path / "run" / "checkpoints" / "0")


@pytest.mark.parametrize("flag, message", [
    ("--temperature=-1", r"--temperature=-1.0 must be >= 0"), ("--top_k=-2", r"--top_k=-2 must be >= 0"),
    ("--top_p=0", r"--top_p=0.0 must be in \(0, 1\]"), ("--top_p=1.5", r"--top_p=1.5 must be in \(0, 1\]"),
    ("--max_new_tokens=0", r"--max_new_tokens=0 must be >= 1"), ("--beam_size=0", r"--beam_size=0 must be >= 1"),
])
def test_generate_flags_out_of_range_fail_naming_the_flag_before_the_run_is_read(flag, message):
    values = flags.FlagValues()
    for name, default in [("temperature", 0.8), ("top_p", 1.0)]:
        flags.DEFINE_float(name, default, "", flag_values=values)
    for name, default in [("top_k", 0), ("seed", 0), ("max_new_tokens", 5), ("num_samples", 1), ("beam_size", 1)]:
        flags.DEFINE_integer(name, default, "", flag_values=values)
    flags.DEFINE_string("workdir", "/no/such/run", "", flag_values=values)
    values(["generate", flag])
    with pytest.raises(ValueError, match=message):
        generate.generate_cli(values)


@pytest.mark.slow
def test_evaluate_and_a_finished_run_say_what_they_read_and_do(tmp_path, corpus, small_gpt_config, capsys):
    workdir = str(tmp_path / "run")
    loop.train(small_gpt_config(f"data.source={corpus}", "train.steps=2", "train.eval_every=2",
                                "data.eval_fraction=0.3", "train.sample_tokens=4"), workdir)
    said = capsys.readouterr()
    eval_documents = store.Store.open(os.path.join(workdir, "store")).documents("eval", 1)
    start = bytes(eval_documents[0][:lm.PROMPT_TOKENS].tolist()).decode("utf-8", "replace").rstrip("\ufffd")
    first_line = start.split("\n")[0]
    assert "--- sample at step 2 (from an eval document's start; config.train.sample_prompt sets it):\n" \
           + first_line in said.out + said.err

    evaluation.evaluate_run(workdir, record=False)
    assert capsys.readouterr().err.splitlines()[0] == f"data: the eval split of {corpus}"
    evaluation.evaluate_run(workdir, overrides={"data.source": corpus}, record=False)
    assert capsys.readouterr().err.startswith(f"data: the eval split of {corpus} (given): text this run has not "
                                              "tokenized, tokenized whole into a scratch directory first")

    done = subprocess.run([sys.executable, "-m", "transformer.train", "--workdir", workdir], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0 and done.stdout == (f"{workdir}: the run is complete at step 2 (config.train.steps=2); "
                                                    "--config.train.steps=4 trains it on to step 4\n"), done.stderr


def test_no_data_line_is_said_before_a_source_that_matches_no_files_fails(tmp_path, small_gpt_config, capsys):
    with pytest.raises(FileNotFoundError, match="no files match"):
        checks.checked(small_gpt_config(f"data.source={tmp_path / 'none' / '*.txt'}"), workdir=str(tmp_path / "run"))
    assert "data:" not in capsys.readouterr().err


def test_an_encoder_decoder_says_its_data_line():
    config = config_lib.load(os.path.join(REPO, "configs/encdec.py:tiny"), [])
    assert shapes.resolve(config) == ["data: the embedded code2doc task (stdlib functions -> the first line of their "
                                      "docstring): source<TAB>target pairs, tokenized by bpe (2,048 ids, trained on "
                                      "both sides)"]


def test_a_long_line_is_tokenized_in_pieces_with_the_ids_of_the_whole(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(store_encoding, "_SAID", {})  # said once per process: this test's process anew
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghij"), n)) for n in rng.integers(1, 9, 500)]
    line = " ".join(rng.choice(words, 150_000)) + "  tail,  end"  # ~0.8 MB on one line, runs of spaces too
    (tmp_path / "line.txt").write_text(line)
    store_build.build(settings(str(tmp_path / "line.txt"), "bpe", eval_fraction=0.0), str(tmp_path / "st"), 0,
                      progress=False)
    assert "is tokenized in pieces of at most 65,536 (a bounded memory), cut between words" in capfd.readouterr().err
    built = store.Store.open(str(tmp_path / "st"))
    whole = built.tokenizer().tokenizer.encode(line, add_special_tokens=False).ids  # one piece: the reference
    assert built.documents("train", 1)[0].tolist() == whole

    glued = "x" * 2500 + " " + "y" * 10
    pieces = list(store_encoding.pieces(glued, 1000))
    assert "".join(pieces) == glued and [len(p) for p in pieces] == [1000, 1000, 511]
    assert "cut inside a word" in capfd.readouterr().err
    tokenizer = tokenizers.train_bpe([line[:20000]], 300).tokenizer
    encode = lambda texts: [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    short = line[:5000]
    split = store_encoding.in_pieces(encode, 100, 700)([short, "a b"])
    assert [list(ids) for ids in split] == encode([short, "a b"])


def test_a_huge_batch_fails_on_its_memory_before_any_data_work(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_COMPILES}
    (tmp_path / "text.txt").write_text("some text to tokenize. " * 50)
    out = subprocess.run([sys.executable, "-m", "transformer.train", "--config", f"{REPO}/configs/gpt.py:tiny",
                          f"--config.data.source={tmp_path / 'text.txt'}", "--config.data.batch_size=100000000",
                          "--workdir", str(tmp_path / "run")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    error = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert error == [line for line in error if "config.data.batch_size=100000000: one layer's activations" in line]
    assert len(error) == 1 and "lower it, or raise config.optim.accum_steps=1" in error[0]
    assert not {"store", "tokenizer_config.json"} & set(os.listdir(tmp_path / "run"))  # no data read or written
