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
        self.dropped = 0  # the oldest messages the last turn dropped to fit the context (`ChatFormat.fitted`)
        self.turns = 0

    def stream(self, text: str) -> Iterator[str]:
        """The reply to a user's `text`, piece by piece as it is written; the turn is kept for the next."""
        context = self.engine.context
        room = context - min(self.settings.max_new_tokens, context // 4)  # the rest: the answer's
        asked = [*self.messages, {"role": "user", "content": text}]
        self.messages, prompt, self.dropped = self.chat.fitted(asked, room)  # the oldest turns dropped to fit
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
