"""A conversation with a chat model over the key/value cache: each turn feeds only the tokens the cache
lacks (the new user turn and the template's markers), never the whole history again.

    session = chat.Session.open("runs/sft", system="Be brief.", temperature=0)
    session.say("reverse cat")        # 'tac'; session.reset() starts over (the system prompt kept)
    for piece in session.stream("and dog?"): print(piece, end="")

A reply ends at the chat format's end-of-turn marker (or at max_new_tokens, or the model's context).
Glossary of shapes: N tokens fed at once.
"""

import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from transformer import rundir
from transformer.data.text import chat_templates
from transformer.inference import decoding

CACHE_COUNTERS = ("cache_index", "position")  # the cache's leaves that say where decoding is


def check_sampling(temperature: float, top_k: int, top_p: float, max_new_tokens: int) -> None:
    """Sampling settings, each wrong one failing in one line that names it."""
    if temperature < 0:
        raise ValueError(f"--temperature={temperature} must be >= 0 (0: greedy)")
    if top_k < 0:
        raise ValueError(f"--top_k={top_k} must be >= 0 (0: every token)")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top_p={top_p} must be in (0, 1]")
    if max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens={max_new_tokens} must be at least 1")


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def _feed(model, params, cache, tokens):
    """tokens [1, N] appended to the cache -> (the last position's logits [1, V], the cache)."""
    logits, variables = model.apply({"params": params, "cache": cache}, tokens, decode=True, last_only=True,
                                    mutable=["cache"])
    return logits[:, -1], variables["cache"]


_sample = jax.jit(decoding.sample_logits, static_argnames=("temperature", "top_k", "top_p"))


def rewind(cache, length: int):
    """The cache cut back to its first `length` positions (the keys past them are masked as the future)."""
    def cut(path, x):
        return jnp.full_like(x, length) if getattr(path[-1], "key", None) in CACHE_COUNTERS else x
    return jax.tree_util.tree_map_with_path(cut, cache)


def fitting(chat: chat_templates.ChatFormat, messages: list[dict], room: int) -> tuple[list[dict], list[int], int]:
    """(the messages with their oldest turns dropped, a system prompt kept, until the prompt is at most `room`
    tokens; its ids; how many messages were dropped). A last message that does not fit alone fails in one line."""
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(system):]
    while True:
        prompt = chat.prompt(system + turns).tolist()
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


class Session:
    def __init__(self, model, params, chat: chat_templates.ChatFormat, system: str = "", temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, max_new_tokens: int = 256, seed: int = 0):
        check_sampling(temperature, top_k, top_p, max_new_tokens)
        if getattr(model, "window", 0):
            raise ValueError("a sliding-window model's cache cannot be cut back: chat needs a full cache")
        self.model = model.clone(cache_length=model.max_len)
        self.params, self.chat, self.system = params, chat, system
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self.max_new_tokens, self.rng = max_new_tokens, jax.random.key(seed)
        self.reset()

    @classmethod
    def open(cls, workdir: str, step: int | None = None, **kwargs) -> "Session":
        run = rundir.open(workdir)
        return cls(run.model(), run.restore_params(step), run.chat_format(required=True), **kwargs)

    def reset(self) -> None:
        """Forgets the conversation (the system prompt stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.dropped = 0  # the oldest messages the last turn dropped to fit the context (`fitting`)
        self.fed: list[int] = []  # the ids the cache holds, in order
        self.cache = decoding.init_cache(self.model, 1)

    def _feed_ids(self, ids: list[int]):
        """Feeds ids into the cache in chunks of powers of two (a few shapes compile); the last logits."""
        logits, at = None, 0
        while at < len(ids):
            n = 1 << (len(ids) - at).bit_length() - 1
            logits, self.cache = _feed(self.model, self.params, self.cache, jnp.asarray([ids[at:at + n]], jnp.int32))
            at += n
        self.fed += ids
        return logits

    def stream(self, text: str) -> Iterator[str]:
        """The reply to a user's `text`, piece by piece as it is written; the turn is kept for the next."""
        room = self.model.max_len - min(self.max_new_tokens, self.model.max_len // 4)  # the rest: the answer's
        asked = [*self.messages, {"role": "user", "content": text}]
        self.messages, prompt, self.dropped = fitting(self.chat, asked, room)  # the oldest turns dropped to fit
        same = next((i for i, (a, b) in enumerate(zip(self.fed, prompt)) if a != b), min(len(self.fed), len(prompt)))
        same = min(same, len(prompt) - 1)  # at least one token fed, for the next logits
        self.cache, self.fed = rewind(self.cache, same), self.fed[:same]
        logits = self._feed_ids(prompt[same:])
        reply, shown = [], ""
        for _ in range(min(self.max_new_tokens, self.model.max_len - len(prompt))):
            token = int(_sample(logits, jax.random.fold_in(self.rng, len(self.fed)), **self.sampling)[0])
            if token in self.chat.end_ids:
                break
            reply.append(token)
            text_so_far = self.chat.decode(reply)
            if not text_so_far.endswith("\ufffd"):  # a character's bytes not all written yet
                yield text_so_far[len(shown):]
                shown = text_so_far
            logits = self._feed_ids([token])
        answer = self.chat.decode(reply)
        if len(answer) > len(shown):
            yield answer[len(shown):]
        self.messages.append({"role": "assistant", "content": answer})

    def say(self, text: str) -> str:
        """The whole reply to a user's `text`."""
        return "".join(self.stream(text))
