"""Tests of the data package: sources and tokenizers (token stores: test_store.py; LM batches: test_lm_data.py)."""

import json
import os

import ml_collections
import numpy as np
import pytest
from conftest import UNICODE

from transformer.data.text import sources, tokenizers


def data_config(source, **overrides) -> ml_collections.ConfigDict:
    fields = dict(source=source, text_field="text", tokenizer="byte", vocab_size=512,
                  tokenizer_path="", seq_len=32, batch_size=8, eval_fraction=0.2,
                  eval_batches=2)
    fields.update(overrides)
    return ml_collections.ConfigDict(fields)


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


def test_stdlib_source_has_files_outside_site_packages():
    files = sources.resolve_files(sources.STDLIB)
    assert len(files) > 1000
    assert not any("site-packages" in f or "dist-packages" in f for f in files)


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
