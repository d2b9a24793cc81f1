"""Talk with a chat model (a run fine-tuned with the sft task, or a converted model with a chat template).

  python -m transformer.chat --workdir runs/gpt-tiny-sft [--system "Be brief."] [--temperature 0.7 --top_p 0.9]
  python -m transformer.chat --workdir runs/gpt-tiny-sft --message "reverse cat"   # one answer, for scripts

Each line typed is a user turn; the answer streams until the end-of-turn marker. /reset starts over (the
system prompt kept), /quit or end of input leaves. Where the conversation outgrows the model's context, its
oldest turns are dropped (said in a line before the answer), the system prompt kept. Each turn goes through the
engine (`transformer.inference.chat`).
"""

import sys

from absl import flags

from transformer import cli
from transformer.inference import chat, sampling


def main(argv):
    f = flags.FLAGS
    settings = sampling.Sampling(**cli.sampling_fields(f))
    session = chat.Session.open(f.workdir, f.step, system=f.system, settings=settings)
    if f.message:
        print(session.say(f.message))
        return
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/quit":
            break
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            session.reset()
            print("(conversation reset)", flush=True)
            continue
        try:
            pieces = session.stream(text)
            first = next(pieces, "")  # the turn is fitted to the context before its first piece
            if session.dropped:
                print(f"(the {session.dropped} oldest messages dropped: the conversation outgrew the model's "
                      f"context of {session.engine.context} tokens)", flush=True)
            for piece in [first, *pieces]:
                print(piece, end="", flush=True)
        except ValueError as e:
            print(f"error: {e}", flush=True)
            continue
        print(flush=True)


if __name__ == "__main__":
    flags.DEFINE_string("workdir", None, "A chat model's run directory (it holds chat_template.json).")
    flags.DEFINE_string("system", "", "A system prompt, the first turn of every conversation.")
    flags.DEFINE_string("message", "", "Answer this one message and exit.")
    cli.define_sampling(256, 0.0, "Tokens of an answer at most.")
    cli.define_step()
    flags.mark_flag_as_required("workdir")
    cli.run(main)
