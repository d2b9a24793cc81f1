"""Conversations for supervised fine-tuning: JSON lines read, rendered by a chat format and packed.

A line is `{"messages": [{"role": "system" | "user" | "assistant", "content": TEXT}, ...]}` (the format of
the OpenAI API and of Hugging Face chat data sets) or a prompt/completion pair, `{"prompt": TEXT or messages,
"completion": TEXT or messages}` (TRL's), which is the user's turn and the assistant's answer. Each
conversation becomes ids and the mask of its assistant tokens (`chat_templates`); one longer than a row
is cut, and dropped where no assistant token is left. Rows pack several conversations (best fit, longest
first), each a segment of its own, as pretraining packs documents.

Glossary of shapes: R rows, W = L + 1 tokens of a row (L inputs and targets), B batch.
"""

import bisect
import dataclasses
import hashlib
import json
from collections.abc import Iterator

import numpy as np


def _messages(value, where: str, role: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise ValueError(f"{where}: expected text or a list of messages")


def json_lines(path: str) -> Iterator[tuple[str, object]]:
    """(path:line, the parsed line) of each non-blank line of a JSON-lines file; one not JSON fails naming it."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        raise FileNotFoundError(f"config.data.train_path: cannot read {path}: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield f"{path}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None


def read(path: str) -> list[list[dict]]:
    """The conversations of a JSON-lines file; a line of another shape fails naming it (path:line)."""
    out = []
    for where, row in json_lines(path):
        if isinstance(row, dict) and "messages" in row:
            out.append(_messages(row["messages"], where, "user"))
        elif isinstance(row, dict) and {"prompt", "completion"} <= set(row):
            out.append(_messages(row["prompt"], where, "user") + _messages(row["completion"], where, "assistant"))
        else:
            raise ValueError(f'{where}: expected {{"messages": [...]}} or {{"prompt": ..., "completion": ...}}')
    if not out:
        raise ValueError(f"{path} holds no conversations")
    return out


def held_out(conversation: list[dict], fraction: float) -> bool:
    """Whether a conversation is in the eval split (by a hash of its text: the same in every run)."""
    digest = hashlib.sha256(json.dumps(conversation, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64 < fraction


@dataclasses.dataclass
class Encoded:
    examples: list[tuple[np.ndarray, np.ndarray]]  # (ids [T], assistant mask [T]) of each conversation kept
    cut: int        # conversations cut to the row's width
    dropped: int    # conversations with no assistant token within the width (left out)


def encode(chat, conversations: list[list[dict]], width: int, where: str) -> Encoded:
    """Each conversation's ids and assistant mask, cut to `width` tokens; a malformed one fails naming it."""
    examples, cut, dropped = [], 0, 0
    for i, conversation in enumerate(conversations):
        try:
            ids, mask = chat.encode(conversation)
        except ValueError as e:
            raise ValueError(f"{where}: conversation {i}: {e}") from None
        if len(ids) > width:
            ids, mask, cut = ids[:width], mask[:width], cut + 1
        if not mask[1:].any():
            dropped += 1
            continue
        examples.append((ids, mask))
    return Encoded(examples, cut, dropped)


@dataclasses.dataclass
class Packed:
    tokens: np.ndarray     # int32 [R, W], 0 after the last conversation of a row
    mask: np.ndarray       # bool [R, W]: an assistant token (a target the loss counts)
    segments: np.ndarray   # int32 [R, W]: 1, 2, ... each conversation of the row; 0 the padding
    positions: np.ndarray  # int32 [R, W]: each token's place in its conversation

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def filled(self) -> float:
        return float((self.segments > 0).mean()) if len(self) else 0.0

    def batch(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """{'tokens' [B, W], 'weights' float32 [B, L] (targets counted), 'segments', 'positions' [B, L]}."""
        tokens, mask, segments = self.tokens[rows], self.mask[rows], self.segments[rows]
        weights = mask[:, 1:] & (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
        return {"tokens": tokens, "weights": weights.astype(np.float32), "segments": segments[:, :-1],
                "positions": self.positions[rows][:, :-1]}


def pack(examples: list[tuple[np.ndarray, np.ndarray]], width: int) -> Packed:
    """Examples (each at most `width` tokens) packed into rows of `width`: best fit, longest first."""
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i][0]))
    rows, free = [], []  # free: sorted (space left, row)
    for i in order:
        n = len(examples[i][0])
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            rows.append([])
            row = len(rows) - 1
        else:
            row = free.pop(at)[1]
        rows[row].append(i)
        bisect.insort(free, (width - sum(len(examples[j][0]) for j in rows[row]), row))
    tokens = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), bool)
    segments, positions = np.zeros_like(tokens), np.zeros_like(tokens)
    for r, members in enumerate(rows):
        at = 0
        for s, i in enumerate(sorted(members), 1):
            ids, m = examples[i]
            tokens[r, at:at + len(ids)], mask[r, at:at + len(ids)] = ids, m
            segments[r, at:at + len(ids)], positions[r, at:at + len(ids)] = s, np.arange(len(ids))
            at += len(ids)
    return Packed(tokens, mask, segments, positions)
