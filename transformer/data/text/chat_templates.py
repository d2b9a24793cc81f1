"""Chat templates: conversations rendered to token ids, with the mask of the assistant's tokens.

A run's chat format is its Jinja `chat_template` (an imported Hugging Face model's, from its
tokenizer_config.json; a run trained here gets BUILT_IN, whose role and end-of-turn markers are special
tokens added after the tokenizer's ids), rendered as transformers' `apply_chat_template` renders it
(the same sandboxed Jinja environment, filters and `{% generation %}` blocks) and tokenized to the same
ids, with one difference by design: a message's content is never parsed into special tokens, so text a
user writes that spells a marker stays ordinary text. The assistant mask marks each assistant message's
content through its end-of-turn marker (a template's `{% generation %}` spans, where it has them).

    chat = rundir.open("runs/sft").chat_format()
    ids, mask = chat.encode([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    prompt = chat.encode(messages, add_generation_prompt=True)[0]; chat.end_ids  # where a reply stops

Glossary of shapes: T tokens of a rendered conversation.
"""

import contextvars
import dataclasses
import datetime
import json
import os
import re

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np

from transformer.data.text import tokenizers

FILE = "chat_template.json"  # a run's chat format: {chat_template, bos_token, eos_token, added: {marker: id}}
ROLES = ("system", "user", "assistant")
END = "<|end|>"
_STAND_INS = (0xE000, 0xF8FF)  # private-use characters that mark where each message's content renders
BUILT_IN_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", END)
BUILT_IN = (
    "{% for message in messages %}"
    "{% if message['role'] not in ('system', 'user', 'assistant') %}"
    "{{ raise_exception('roles are system, user and assistant, not ' + message['role']) }}{% endif %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_tracking: contextvars.ContextVar = contextvars.ContextVar("generation_spans", default=None)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: records the [start, end) characters of its output."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

    def _track(self, caller) -> str:
        text = caller()
        if (tracking := _tracking.get()) is not None:
            blocks, spans = tracking
            start = sum(map(len, blocks))
            spans.append((start, start + len(text)))
        return text


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    """The template as transformers compiles it (sandboxed, trim_blocks, lstrip_blocks, its globals)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda f: datetime.datetime.now().strftime(f))
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse (line {e.lineno}): {e.message}") from None


def check_messages(messages) -> list[dict]:
    """Messages as the templates take them; a malformed one fails naming it (messages[i].content, ...)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with role and content")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role={m.get('role')!r}: choose one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


@dataclasses.dataclass
class Rendered:
    text: str
    contents: list[tuple[int, int]]     # each message's content [start, end) in text (never parsed as markers)
    generation: list[tuple[int, int]]   # the template's {% generation %} spans


class ChatFormat:
    """A tokenizer with a chat template and its markers (special-token text -> id)."""

    def __init__(self, tokenizer, template: str, markers: dict[str, int], bos_token: str = "",
                 eos_token: str = "", added: dict[str, int] | None = None):
        self.tokenizer, self.source, self.markers = tokenizer, template, dict(markers)
        self.bos_token, self.eos_token, self.added = bos_token, eos_token, dict(added or {})
        self.template = compile_template(template)
        self._split = re.compile("|".join(map(re.escape, sorted(self.markers, key=len, reverse=True)))
                                 if self.markers else r"(?!)")
        self.end_ids = self._end_ids()

    @property
    def vocab_size(self) -> int:
        """The ids this format writes: the tokenizer's and its added markers'."""
        return max([self.tokenizer.vocab_size, *(i + 1 for i in self.added.values())])

    def render(self, messages, add_generation_prompt: bool = False) -> Rendered:
        messages = check_messages(messages)
        text, generation = self._render(messages, add_generation_prompt)
        spans = self._locate(messages, add_generation_prompt, text) or _content_spans(text, messages)
        return Rendered(text, spans, generation)

    def _locate(self, messages, add_generation_prompt: bool, text: str) -> list[tuple[int, int]] | None:
        """Each content's span, read off a rendering with a stand-in character for each message's content
        (the content as it is, or trimmed where the template trims); None where the template writes a
        stand-in other than it writes text (it branches on the content)."""
        if len(messages) > _STAND_INS[1] - _STAND_INS[0]:
            return None
        stand_ins = [{**m, "content": chr(_STAND_INS[0] + i)} for i, m in enumerate(messages)]
        marked = self._render(stand_ins, add_generation_prompt)[0]
        spans, at, out = [(0, 0)] * len(messages), 0, 0
        for j, c in enumerate(marked):
            i = ord(c) - _STAND_INS[0]
            if not 0 <= i < len(messages):
                continue
            if text[out:out + j - at] != marked[at:j]:
                return None
            out += j - at
            content = next((v for v in (messages[i]["content"], messages[i]["content"].strip())
                            if text.startswith(v, out)), None)
            if content is None:
                return None
            spans[i] = (out, out + len(content)) if spans[i] == (0, 0) else spans[i]
            at, out = j + 1, out + len(content)
        return spans if text[out:] == marked[at:] else None

    def _render(self, messages, add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        blocks, spans = [], []
        token = _tracking.set((blocks, spans))
        try:
            for block in self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                bos_token=self.bos_token, eos_token=self.eos_token):
                blocks.append(block)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template fails on these messages: {e}") from None
        finally:
            _tracking.reset(token)
        return "".join(blocks), spans

    def encode(self, messages, add_generation_prompt: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 [T], assistant mask bool [T]): the assistant's content and its end-of-turn marker."""
        rendered = self.render(messages, add_generation_prompt)
        ids, starts, ends = self._tokenize(rendered)
        spans = rendered.generation or self._assistant_spans(rendered, messages)
        mask = np.zeros(len(ids), bool)
        for lo, hi in spans:
            mask |= (starts < hi) & (ends > lo) if hi > lo else False
        return ids, mask

    def prompt(self, messages) -> np.ndarray:
        """The ids that ask for the next assistant message."""
        return self.encode(messages, add_generation_prompt=True)[0]

    def fitted(self, messages: list[dict], room: int) -> tuple[list[dict], list[int], int]:
        """(the messages with their oldest turns dropped, a system prompt kept, until the prompt is at most `room`
        tokens; its ids; how many messages were dropped). A last message that does not fit alone fails in one line."""
        system = messages[:1] if messages and messages[0]["role"] == "system" else []
        turns = messages[len(system):]
        while True:
            prompt = self.prompt(system + turns).tolist()
            if len(prompt) <= room or len(turns) == 1:
                break
            turns = turns[1:]
            while len(turns) > 1 and turns[0]["role"] != "user":  # a conversation starts with the user's turn
                turns = turns[1:]
        if len(prompt) > room:
            with_system = " and the system prompt" if system else ""
            raise ValueError(f"the message is {len(prompt)} tokens with the chat markers{with_system}, more than the "
                             f"{room} the model's context leaves it: shorten it")
        return system + turns, prompt, len(messages) - len(system) - len(turns)

    def decode(self, ids) -> str:
        """A reply's text (its markers left out)."""
        return self.tokenizer.decode([i for i in np.asarray(ids).tolist() if i < self.tokenizer.vocab_size])

    def _tokenize(self, rendered: Rendered) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, each token's first character, its end) of the rendered text: markers outside the contents
        become their ids, the text between them is tokenized with no special tokens parsed."""
        text, pieces, at = rendered.text, [], 0
        for m in self._split.finditer(text):
            if any(lo < m.end() and m.start() < hi for lo, hi in rendered.contents):
                continue
            pieces += [(at, m.start(), None), (m.start(), m.end(), self.markers[m.group()])]
            at = m.end()
        pieces.append((at, len(text), None))
        ids, starts, ends = [], [], []
        for lo, hi, marker in pieces:
            if marker is not None:
                ids.append(marker), starts.append(lo), ends.append(hi)
            elif hi > lo:
                piece_ids, offsets = plain_encode(self.tokenizer, text[lo:hi])
                ids += piece_ids
                starts += [lo + a for a, _ in offsets]
                ends += [lo + b for _, b in offsets]
        return np.asarray(ids, np.int32), np.asarray(starts, np.int64), np.asarray(ends, np.int64)

    def _assistant_spans(self, rendered: Rendered, messages) -> list[tuple[int, int]]:
        """Each assistant message's content through the first marker after it (its end of turn)."""
        spans = []
        for (lo, hi), m in zip(rendered.contents, messages):
            if m["role"] != "assistant":
                continue
            after = self._split.search(rendered.text, hi)
            if lo == hi:  # empty: where it lies is its end of turn's place
                while after and self.markers[after.group()] not in self.end_ids:
                    after = self._split.search(rendered.text, after.end())
                lo = after.start() if after else hi
            spans.append((lo, after.end() if after else hi))
        return spans

    def _end_ids(self) -> tuple[int, ...]:
        """The ids that end an assistant turn: the marker the template writes after an assistant's content,
        and the end-of-text token."""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        rendered = self.render(probe)
        after = self._split.search(rendered.text, rendered.contents[1][1])
        ends = [self.markers[after.group()]] if after else []
        if self.eos_token in self.markers:
            ends.append(self.markers[self.eos_token])
        return tuple(dict.fromkeys(ends))

    def save(self, directory: str) -> None:
        with open(os.path.join(directory, FILE), "w") as f:
            json.dump({"chat_template": self.source, "bos_token": self.bos_token, "eos_token": self.eos_token,
                       "added": self.added}, f, indent=1, ensure_ascii=False)


def _content_spans(text: str, messages) -> list[tuple[int, int]]:
    """Where each message's content lies in the rendered text (in order; trimmed, where the template trims)."""
    spans, at = [], 0
    for i, m in enumerate(messages):
        for content in (m["content"], m["content"].strip()):
            start = text.find(content, at)
            if start >= 0:
                break
        else:
            raise ValueError(f"the chat template does not write messages[{i}].content as it is")
        spans.append((start, start + len(content)))
        at = start + len(content)
    return spans


def plain_encode(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, each one's [start, end) characters) of text, no special token parsed out of it."""
    if isinstance(tokenizer, tokenizers.ByteTokenizer):
        data = text.encode("utf-8")
        chars = np.repeat(np.arange(len(text)), [len(c.encode("utf-8")) for c in text])
        return list(data), [(int(c), int(c) + 1) for c in chars]
    if not isinstance(tokenizer, tokenizers.HFTokenizer):
        raise ValueError(f"chat templates take a byte, BPE, WordPiece, GPT-2 or Hugging Face tokenizer, not "
                         f"{tokenizer.kind!r}")
    inner = tokenizer.tokenizer
    inner.encode_special_tokens = True
    try:
        encoding = inner.encode(text, add_special_tokens=False)
    finally:
        inner.encode_special_tokens = False
    return encoding.ids, encoding.offsets


def hf_markers(tokenizer) -> dict[str, int]:
    """An imported tokenizer's special added tokens (text -> id): the markers its template writes."""
    if not isinstance(tokenizer, tokenizers.HFTokenizer):
        return {}
    return {t.content: i for i, t in tokenizer.tokenizer.get_added_tokens_decoder().items() if t.special}


def built_in(tokenizer) -> "ChatFormat":
    """BUILT_IN over `tokenizer`, its markers added as new ids after the tokenizer's."""
    added = {m: tokenizer.vocab_size + i for i, m in enumerate(BUILT_IN_MARKERS)}
    return ChatFormat(tokenizer, BUILT_IN, {**hf_markers(tokenizer), **added}, added=added)


def from_hf_config(tokenizer, config: dict) -> "ChatFormat | None":
    """The chat format a Hugging Face tokenizer_config.json names (its chat_template), None where it has none."""
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template:
        return None
    token = lambda v: (v.get("content") if isinstance(v, dict) else v) or ""
    return ChatFormat(tokenizer, template, hf_markers(tokenizer), token(config.get("bos_token")),
                      token(config.get("eos_token")))


def from_hf_directory(tokenizer, directory: str) -> "ChatFormat | None":
    """The chat format of a Hugging Face model directory (its tokenizer_config.json's chat_template, else its
    chat_template.jinja, as transformers saves it now), None where it has none."""
    config_path = os.path.join(directory, tokenizers.CONFIG_FILE)
    config = json.load(open(config_path, encoding="utf-8")) if os.path.isfile(config_path) else {}
    jinja = os.path.join(directory, "chat_template.jinja")
    if "chat_template" not in config and os.path.isfile(jinja):
        config["chat_template"] = open(jinja, encoding="utf-8").read()
    return from_hf_config(tokenizer, config)


def from_saved(tokenizer, path: str) -> ChatFormat:
    """The chat format a run saved at `path` (its chat_template.json, `ChatFormat.save`) over its `tokenizer`;
    a run's is `rundir.RunDir.chat_format`."""
    with open(path) as f:
        saved = json.load(f)
    added = {k: int(v) for k, v in saved.get("added", {}).items()}
    return ChatFormat(tokenizer, saved["chat_template"], {**hf_markers(tokenizer), **added},
                      saved.get("bos_token", ""), saved.get("eos_token", ""), added)
