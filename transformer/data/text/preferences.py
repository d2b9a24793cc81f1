"""Preference pairs for DPO: JSON lines of {"prompt", "chosen", "rejected"}, each pair two padded rows.

A line is TRL's preference format: `{"prompt": TEXT, "chosen": TEXT, "rejected": TEXT}` (plain text: the
prompt's ids followed by the response's, which end in the tokenizer's [EOS] where it has one, as TRL's do), or
the conversational one, where the prompt is a list of messages and each response an assistant message or a
list of them (`"chosen": [{"role": "assistant", "content": ...}]`, or TEXT), rendered by the run's chat
format. The loss counts the response's tokens only: as TRL's completion, all that follows the prompt, from where the ids
of prompt + response (tokenized together, as TRL does: a prompt ending in a space joins its response's first
word) leave the prompt's own ids, the earlier of the pair's two; for a conversation, where its rendering leaves
the prompt's with the generation prompt (the assistant's content, its end-of-turn marker and what the template
writes after it, as ChatML's newline). A response longer
than the row is cut; a missing field, an empty response or a prompt that leaves no room for a response token
fails naming the file and line.

Glossary of shapes: N pairs, W = L + 1 tokens of a row (L inputs and targets), B batch.
"""

import dataclasses

import numpy as np

from transformer.data.text import conversations

FIELDS = ("prompt", "chosen", "rejected")


@dataclasses.dataclass
class Pairs:
    """N pairs as rows of width W, 0 after each sequence's end."""

    chosen: np.ndarray            # int32 [N, W]
    rejected: np.ndarray          # int32 [N, W]
    chosen_mask: np.ndarray       # bool [N, W]: a response token of chosen
    rejected_mask: np.ndarray     # bool [N, W]
    prompts: list                 # each pair's prompt (text or messages), for greedy answers
    where: list[str]              # each pair's file:line
    cut: int = 0                  # pairs with a response cut to the width

    def __len__(self) -> int:
        return len(self.chosen)

    def batch(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """{'chosen', 'rejected': int32 [B, W], 'chosen_weights', 'rejected_weights': float32 [B, L] (the
        response's targets)}."""
        return {"chosen": self.chosen[rows], "rejected": self.rejected[rows],
                "chosen_weights": self.chosen_mask[rows, 1:].astype(np.float32),
                "rejected_weights": self.rejected_mask[rows, 1:].astype(np.float32)}

    def subset(self, keep: np.ndarray) -> "Pairs":
        keep = np.asarray(keep, bool)
        pick = [i for i in np.flatnonzero(keep)]
        return Pairs(self.chosen[keep], self.rejected[keep], self.chosen_mask[keep], self.rejected_mask[keep],
                     [self.prompts[i] for i in pick], [self.where[i] for i in pick], self.cut)


def _messages(value, role: str, where: str, field: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ValueError(f"{where}: {field} must be text or a list of messages")
    return value


def _empty(value) -> bool:
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, dict):
        value = [value]
    return not value or all(not str(m.get("content", "")).strip() for m in value)


def _encode(prompt, response, chat, tokenizer, where: str, field: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids of prompt + response, the prompt's ids): plain text tokenized whole, as TRL tokenizes it (a prompt
    ending in a space joins its response's first word), then [EOS]; messages rendered by the chat format."""
    if isinstance(prompt, str) and isinstance(response, str):
        ids, eos = np.asarray(tokenizer.encode(prompt + response)), tokenizer.special_id("[EOS]")
        if eos is not None and (not len(ids) or ids[-1] != eos):
            ids = np.append(ids, eos)
        return ids.astype(np.int32), np.asarray(tokenizer.encode(prompt))
    if chat is None:
        raise ValueError(f"{where}: a conversation needs a chat template, and config.init_from has none "
                         "(chat_template.json): fine-tune it with the sft task first, or give plain text")
    asked = _messages(prompt, "user", where, "prompt")
    try:
        ids = np.asarray(chat.encode(asked + _messages(response, "assistant", where, field))[0], np.int32)
        return ids, np.asarray(chat.prompt(asked))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _parting(ids: np.ndarray, head: np.ndarray) -> int:
    """Where `ids` leave the prompt's ids `head` (TRL's common_prefix_length)."""
    n = min(len(ids), len(head))
    differ = np.flatnonzero(ids[:n] != head[:n])
    return int(differ[0]) if len(differ) else n


def read(path: str, width: int, chat=None, tokenizer=None) -> Pairs:
    """The pairs of a JSON-lines file, each row cut to `width` tokens; a bad line fails naming path:line."""
    tokenizer = tokenizer if tokenizer is not None else getattr(chat, "tokenizer", None)
    rows, prompts, wheres, cut = [], [], [], 0
    for where, row in conversations.json_lines(path):
        if not isinstance(row, dict) or (missing := [f for f in FIELDS if f not in row]):
            raise ValueError(f"{where}: missing {', '.join(missing) if isinstance(row, dict) else 'every'} field "
                             f"of {', '.join(FIELDS)}")
        for field in ("chosen", "rejected"):
            if _empty(row[field]):
                raise ValueError(f"{where}: {field} is empty")
        encoded = [_encode(row["prompt"], row[side], chat, tokenizer, where, side) for side in ("chosen", "rejected")]
        start = min(_parting(ids, head) for ids, head in encoded)  # both responses start there, as in TRL
        if start >= width:
            raise ValueError(f"{where}: the prompt is {start} tokens, leaving no room for a response in "
                             f"rows of {width} (config.data.seq_len + 1): shorten it or raise seq_len")
        cut += sum(len(ids) > width for ids, _ in encoded)
        rows.append([(ids[:width], (np.arange(len(ids)) >= start)[:width]) for ids, _ in encoded])
        prompts.append(row["prompt"])
        wheres.append(where)
    if not rows:
        raise ValueError(f"{path} holds no preference pairs")
    arrays = [np.zeros((len(rows), width), dtype) for dtype in (np.int32, np.int32, bool, bool)]
    for i, ((c, cm), (r, rm)) in enumerate(rows):
        arrays[0][i, :len(c)], arrays[1][i, :len(r)] = c, r
        arrays[2][i, :len(cm)], arrays[3][i, :len(rm)] = cm, rm
    return Pairs(*arrays, prompts, wheres, cut)
