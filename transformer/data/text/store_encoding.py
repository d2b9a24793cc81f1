"""How a token store's documents become ids: the end-of-document id written after each, and
encoders of many documents at once (what the build's workers run).

`batch_encoder` encodes without per-document Python overhead: the UTF-8 bytes for 'byte',
tiktoken built from the local encoder.json for 'gpt2' (never downloaded; the same ids as the
tokenizers path), `encode_batch` for the others. No special tokens are added.
"""

import json
import os
from collections.abc import Callable

import numpy as np
import tokenizers

from transformer.data.text.tokenizers import Tokenizer

BYTE_END_OF_DOCUMENT = 0xFF  # never occurs in UTF-8 text, so a byte store keeps 256 ids and uint8
END_OF_TEXT_TOKENS = ("[EOS]", "<|endoftext|>", "</s>", "[SEP]")  # looked for in this order
GPT2_FILES = ("encoder.json", "vocab.bpe")
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
        return lambda texts: encoding.encode_ordinary_batch(texts, num_threads=1)
    inner = tokenizer.tokenizer
    if inner.truncation or inner.padding:  # a Hugging Face tokenizer.json may ask for either: never here
        inner = tokenizers.Tokenizer.from_str(inner.to_str())
        inner.no_truncation()
        inner.no_padding()
    return lambda texts: [e.ids for e in inner.encode_batch(texts, add_special_tokens=False)]
