"""How a token store's documents become ids: the end-of-document id written after each, and
encoders of many documents at once (what the build's workers run).

`batch_encoder` encodes without per-document Python overhead: the UTF-8 bytes for 'byte',
tiktoken built from the local encoder.json for 'gpt2' (never downloaded; the same ids as the
tokenizers path), `encode_batch` for the others. No special tokens are added.

A long document (a whole file on one line) goes to a tokenizer in pieces of at most PIECE_CHARS
characters (`pieces`), encoded a group of about GROUP_CHARS at a time and joined: the memory of
encoding is then bounded by the group, not the document (a 5 MB line took 1.3 GB in one piece). A
piece ends before a space between two non-space characters, where GPT-2's and Llama 3's patterns,
BERT's whitespace split and a Metaspace end a word anyway, so the ids are the unsplit text's (a
normalizer that prepends to every input, Llama 2's '▁', differs at a piece's start); only a run of
PIECE_CHARS without such a space is cut inside it, said once per process.
"""

import json
import os
import sys
from collections.abc import Callable, Iterator

import numpy as np
import tokenizers

from transformer.data.text.tokenizers import Tokenizer

BYTE_END_OF_DOCUMENT = 0xFF  # never occurs in UTF-8 text, so a byte store keeps 256 ids and uint8
END_OF_TEXT_TOKENS = ("[EOS]", "<|endoftext|>", "</s>", "[SEP]")  # looked for in this order
GPT2_FILES = ("encoder.json", "vocab.bpe")
PIECE_CHARS = 1 << 16
GROUP_CHARS = 1 << 20
_SAID = {}  # what this process has said about cut words, once
_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def end_of_document_id(tokenizer: Tokenizer) -> int:
    """The id written after every document of a token store: byte 0xFF for bytes, else the
    tokenizer's end-of-text special ([EOS] of a trained one, <|endoftext|> of GPT-2's, an 'hf'
    tokenizer's eos token, else its [SEP])."""
    if tokenizer.kind == "byte":
        return BYTE_END_OF_DOCUMENT
    for name in END_OF_TEXT_TOKENS:
        token_id = tokenizer.special_id(name)
        if token_id is not None:
            return token_id
    raise ValueError(f"the {tokenizer.kind!r} tokenizer has no end-of-text token (none of "
                     f"{', '.join(END_OF_TEXT_TOKENS)})")


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character of each byte -> the byte (the inverse of its bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(c): b for c, b in zip(printable + [256 + i for i in range(len(others))], printable + others)}


def gpt2_tiktoken(directory: str):
    """GPT-2's BPE as a `tiktoken.Encoding` built from the local encoder.json (never downloaded).

    Its ranks are encoder.json's ids (GPT-2's merges are numbered in the same order), so its ids
    equal `gpt2_tokenizer`'s (tests/test_store.py checks this on code, unicode and whitespace runs).
    """
    import tiktoken

    path = os.path.join(os.path.expanduser(directory), GPT2_FILES[0])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GPT-2 tokenizer file {path} not found")
    with open(path, encoding="utf-8") as f:
        encoder = json.load(f)
    decoder = _gpt2_byte_decoder()
    special = {"<|endoftext|>": encoder.pop("<|endoftext|>")}
    ranks = {bytes(decoder[c] for c in token): rank for token, rank in encoder.items()}
    return tiktoken.Encoding("gpt2-local", pat_str=_GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=special)


def batch_encoder(tokenizer: Tokenizer, directory: str | None = None) -> Callable[[list[str]], list]:
    """texts -> their ids, one sequence per text, without per-text Python overhead: the UTF-8 bytes
    for 'byte', tiktoken for 'gpt2' when `directory` holds encoder.json (else the tokenizers path,
    the same ids), `encode_batch` for the others. No special tokens are added."""
    if tokenizer.kind == "byte":
        return lambda texts: [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    if tokenizer.kind == "gpt2" and directory and os.path.isfile(os.path.join(directory, GPT2_FILES[0])):
        encoding = gpt2_tiktoken(directory)
        return in_pieces(lambda texts: encoding.encode_ordinary_batch(texts, num_threads=1))
    inner = tokenizer.tokenizer
    if inner.truncation or inner.padding:  # a Hugging Face tokenizer.json may ask for either: never here
        inner = tokenizers.Tokenizer.from_str(inner.to_str())
        inner.no_truncation()
        inner.no_padding()
    return in_pieces(lambda texts: [e.ids for e in inner.encode_batch(texts, add_special_tokens=False)])


def pieces(text: str, limit: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in consecutive pieces of at most `limit` characters, each but the last ending before a space
    that has a non-space character on both sides (the last such space within `limit`); where there is none,
    at `limit` itself (said once per process on stderr)."""
    start = 0
    while len(text) - start > limit:
        end = start + limit
        cut = text.rfind(" ", start + 1, end)
        while cut > start and (text[cut - 1].isspace() or cut + 1 >= len(text) or text[cut + 1].isspace()):
            cut = text.rfind(" ", start + 1, cut)
        if cut <= start:
            cut = end
            if not _SAID.get("cut"):
                _SAID["cut"] = True
                print(f"data: a document holds {limit:,} characters without a space between words; it is "
                      f"tokenized in pieces of {limit:,} characters, each cut inside a word (a bounded memory)",
                      file=sys.stderr)
        yield text[start:cut]
        start = cut
    yield text[start:]


def in_pieces(encode: Callable[[list[str]], list], limit: int = PIECE_CHARS,
              group: int = GROUP_CHARS) -> Callable[[list[str]], list]:
    """`encode` (texts -> ids each) applied to texts longer than `limit` characters in `pieces`, a group of
    about `group` characters of pieces at a time, their ids joined (int32) per text."""
    def joined(text: str) -> np.ndarray:
        if not _SAID.get("pieces"):
            _SAID["pieces"] = True
            print(f"data: a document of {len(text):,} characters is tokenized in pieces of at most {limit:,} (a "
                  "bounded memory), cut between words where it has spaces (there, the same ids)", file=sys.stderr)
        parts, batch, size = [], [], 0
        for piece in pieces(text, limit):
            batch.append(piece)
            size += len(piece)
            if size >= group:
                parts += [np.asarray(ids, np.int32) for ids in encode(batch)]
                batch, size = [], 0
        parts += [np.asarray(ids, np.int32) for ids in encode(batch)] if batch else []
        return np.concatenate(parts)

    def encode_all(texts: list[str]) -> list:
        if all(len(t) <= limit for t in texts):
            return encode(texts)
        out = [None] * len(texts)
        short = [i for i, t in enumerate(texts) if len(t) <= limit]
        for i, ids in zip(short, encode([texts[i] for i in short]) if short else []):
            out[i] = ids
        for i, text in enumerate(texts):
            if len(text) > limit:
                out[i] = joined(text)
        return out

    return encode_all
