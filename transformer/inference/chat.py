"""A conversation with a chat model, through the engine: each turn renders the whole conversation with the
chat format and the engine prefills it (in chunks) and writes the reply.

    session = chat.Session.open("runs/sft", system="Be brief.", settings=Sampling(max_new_tokens=64))
    session.say("reverse cat")        # 'tac'; session.reset() starts over (the system prompt kept)
    for piece in session.stream("and dog?"): print(piece, end="")

A reply ends at the chat format's end-of-turn marker (or at max_new_tokens, or the model's context).
"""

import dataclasses
from collections.abc import Iterator

from transformer import rundir
from transformer.data.text import chat_templates
from transformer.inference import engine, sampling


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
    def __init__(self, model, params, chat: chat_templates.ChatFormat, system: str = "",
                 settings: sampling.Sampling | None = None):
        self.engine = engine.Engine(model, params, slots=1, chat=chat, stop_ids=chat.end_ids)
        self.chat, self.system = chat, system
        self.settings = dataclasses.replace(settings or sampling.Sampling(max_new_tokens=256), stop_ids=chat.end_ids)
        self.reset()

    @classmethod
    def open(cls, workdir: str, step: int | None = None, **kwargs) -> "Session":
        run = rundir.open(workdir)
        return cls(run.model(), run.restore_params(step), run.chat_format(required=True), **kwargs)

    def reset(self) -> None:
        """Forgets the conversation (the system prompt stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.dropped = 0  # the oldest messages the last turn dropped to fit the context (`fitting`)
        self.turns = 0

    def stream(self, text: str) -> Iterator[str]:
        """The reply to a user's `text`, piece by piece as it is written; the turn is kept for the next."""
        context = self.engine.context
        room = context - min(self.settings.max_new_tokens, context // 4)  # the rest: the answer's
        asked = [*self.messages, {"role": "user", "content": text}]
        self.messages, prompt, self.dropped = fitting(self.chat, asked, room)  # the oldest turns dropped to fit
        asked = dataclasses.replace(self.settings, max_new_tokens=min(self.settings.max_new_tokens,
                                                                      context - len(prompt)),
                                    seed=self.settings.seed + self.turns)
        reply, shown = [], ""
        for token in self.engine.stream(prompt, asked):
            if token in self.chat.end_ids:
                break
            reply.append(token)
            so_far = self.chat.decode(reply)
            if not so_far.endswith("\ufffd"):  # a character's bytes not all written yet
                yield so_far[len(shown):]
                shown = so_far
        answer = self.chat.decode(reply)
        if len(answer) > len(shown):
            yield answer[len(shown):]
        self.messages.append({"role": "assistant", "content": answer})
        self.turns += 1

    def say(self, text: str) -> str:
        """The whole reply to a user's `text`."""
        return "".join(self.stream(text))
