"""Hugging Face tokenizers read exactly: every way a model directory carries its tokenizer (tokenizer.json,
vocab.json + merges, Llama 3's, T5's spiece.model, BERT's vocab.txt) encodes as transformers does."""

import json

import numpy as np
import transformers


def varied_strings(count: int = 300) -> list[str]:
    """Code lines, prose with accents / CJK / emoji / RTL, odd whitespace, and random mixtures."""
    code = [line for line in open(json_module_source()).read().splitlines() if line.strip()][:120]
    crafted = ["héllo wörld", "naïve café façade", "你好，世界", "こんにちは 世界", "안녕하세요", "مرحبا بالعالم",
               "emoji 🙂🚀👩‍💻 end", "tabs\tand\n\nnewlines  and   spaces ", "  leading", "trailing  ",
               "[CLS] a [SEP] b [MASK] [PAD]", "<|endoftext|>text<|endoftext|>", "x=1;y=2 # 注释",
               "ΑΒΓ αβγ ÅÄÖ", "don't won't can't", "UPPER lower MiXeD", "1,234.56 $%^&*()", "\u00a0nbsp\u2003em",
               "def f(*args, **kwargs) -> None: ...", "e\u0301 (combining)"]
    rng = np.random.default_rng(0)
    pool = list("abcxyzABC 019_.,;:()[]{}\t\n'\"#@!?-+=/\\é你🙂ü") + [" the ", " def ", "ing", "  "]
    mixed = ["".join(rng.choice(pool, rng.integers(1, 40))) for _ in range(count - len(code) - len(crafted))]
    return code + crafted + mixed


def json_module_source() -> str:
    return json.__file__.replace("__init__.py", "decoder.py")


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def llama3_style(texts: list[str]):
    """A tokenizer.json built as Llama 3's is (its split pattern, byte-level BPE, <|begin_of_text|> added by
    the post-processor), trained here on `texts`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=700, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[(specials[0], tok.token_to_id(specials[0]))])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1])


def t5_spiece(texts: list[str], directory) -> None:
    """A directory holding only a T5-style spiece.model (unigram; <pad> 0, </s> 1, <unk> 2) trained on `texts`."""
    import sentencepiece

    directory.mkdir()
    (directory / "train.txt").write_text("\n".join(texts))
    sentencepiece.SentencePieceTrainer.train(
        input=str(directory / "train.txt"), model_prefix=str(directory / "spiece"), vocab_size=400,
        model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0,
        minloglevel=2)
    for extra in ("train.txt", "spiece.vocab"):
        (directory / extra).unlink()
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "T5Tokenizer", "extra_ids": 10}))


def tokenizer_dirs(tmp_path):
    """(name, directory, transformers tokenizer) for each way a model directory carries its tokenizer."""
    from transformer.data.text import tokenizers

    texts = [open(json_module_source()).read(), "héllo wörld 你好 🙂 naïve café"] * 3
    bpe = tokenizers.train_bpe(texts, 600).tokenizer
    eot = "<|endoftext|>"
    bpe.add_special_tokens([eot])
    transformers.GPT2TokenizerFast(tokenizer_object=bpe, bos_token=eot, eos_token=eot, unk_token=eot) \
        .save_pretrained(tmp_path / "tokenizer_json")
    (tmp_path / "bpe_files").mkdir()
    bpe.model.save(str(tmp_path / "bpe_files"))
    vocab_json = tmp_path / "bpe_files" / "vocab.json"
    vocab_json.write_text(json.dumps({**json.loads(vocab_json.read_text()), eot: bpe.token_to_id(eot)}))
    (tmp_path / "bpe_files" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    llama3_style(texts).save_pretrained(tmp_path / "llama3_tokenizer_json")
    t5_spiece(texts, tmp_path / "t5_spiece")
    transformers.AutoTokenizer.from_pretrained(tmp_path / "t5_spiece").save_pretrained(tmp_path / "t5_tokenizer_json")
    vocab = tokenizers.train_wordpiece([t.lower() for t in texts] + texts, 500).tokenizer.get_vocab()
    for cased in (False, True):
        d = tmp_path / f"vocab_txt_{'cased' if cased else 'uncased'}"
        d.mkdir()
        (d / "vocab.txt").write_text("\n".join(sorted(vocab, key=vocab.get)))
        (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer",
                                                             "do_lower_case": not cased}))
    return [(d.name, d, transformers.AutoTokenizer.from_pretrained(d)) for d in sorted(tmp_path.iterdir())]


def test_tokenizers_encode_exactly_as_transformers_does(tmp_path):
    from transformer.data.text import tokenizers

    strings = varied_strings()
    assert len(strings) == 300
    dirs = tokenizer_dirs(tmp_path)
    assert {"llama3_tokenizer_json", "t5_spiece", "t5_tokenizer_json"} <= {name for name, _, _ in dirs}
    for name, directory, theirs in dirs:
        ours = tokenizers.hf_tokenizer(str(directory))
        for text in strings:
            expected = theirs(text, add_special_tokens=False)["input_ids"]
            assert ours.encode(text).tolist() == expected, (name, text)
        ours.save(str(tmp_path / "run" / name))  # a run directory keeps it
        again = tokenizers.load_tokenizer(str(tmp_path / "run" / name))
        assert [again.encode(t).tolist() for t in strings[:50]] == [ours.encode(t).tolist() for t in strings[:50]]
        assert again.special_id("[UNK]") == theirs.unk_token_id
        if name.startswith("t5"):  # T5's sentinels follow the pieces, <extra_id_0> last
            assert ours.vocab_size == len(theirs) and again.special_id("[EOS]") == theirs.eos_token_id == 1
            assert ours.special_id("<extra_id_0>") == theirs.convert_tokens_to_ids("<extra_id_0>") == len(theirs) - 1
        if name.startswith("llama3"):  # transformers adds <|begin_of_text|> (its post-processor); the tasks here do
            assert theirs("héllo")["input_ids"] == [ours.special_id("[BOS]"), *ours.encode("héllo").tolist()]
