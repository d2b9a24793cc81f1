"""What a request to the OpenAI-compatible server may hold (pydantic records, each number in its range: out of
it, a 400 naming the field), and how a token is written in an answer's logprobs (as OpenAI writes it).

    protocol.ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "seed": 2**80})  # raises
    protocol.token_key(engine, 0xff)  # 'bytes:\\xff' under the byte tokenizer
"""

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from tokenizers import decoders

from transformer.data.text import tokenizers

MAX_TOP_LOGPROBS = 20
MAX_STOPS = 16             # stop strings of one request
SEEDS = (-(2**63), 2**63)  # a seed is an int64, as OpenAI's and vLLM's
_BYTES = {c: b for b, c in tokenizers.byte_characters().items()}


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class Sampling(BaseModel):
    """What both completion routes read: the sampling, the answer's length and stops, the choices."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int = Field(0, ge=SEEDS[0], lt=SEEDS[1])

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ValueError(f"{len(stop)} stop strings, more than this server's {MAX_STOPS}")
        return stop


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt: str
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int]


def token_key(engine, token: int) -> str:
    """A token as OpenAI's logprobs write it: its text, or `bytes:\\xNN...` where its bytes are not whole
    UTF-8 (so that distinct tokens never share a key); a chat marker's text; `token_id:N` past the tokenizer."""
    marker = next((text for text, i in (engine.chat.markers if engine.chat else {}).items() if i == token), None)
    raw = _token_bytes(engine.tokenizer, token) if marker is None else marker.encode()
    if raw is None:
        text = engine.token_text(token)
        return text if text and "\ufffd" not in text else f"token_id:{token}"
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _token_bytes(tokenizer, token: int) -> bytes | None:
    """The bytes a token writes, where the tokenizer says them (bytes, byte-level BPE, <0xNN> byte fallback)."""
    if isinstance(tokenizer, tokenizers.ByteTokenizer):
        return bytes([token]) if token < 256 else None
    if not isinstance(tokenizer, tokenizers.HFTokenizer) or (piece := tokenizer.token(token)) is None:
        return None
    if isinstance(tokenizer.tokenizer.decoder, decoders.ByteLevel) and all(c in _BYTES for c in piece):
        return bytes(_BYTES[c] for c in piece)
    fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
    return bytes([int(fallback[1], 16)]) if fallback else None
