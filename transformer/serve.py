"""Serve a run over HTTP with OpenAI's API (chat and completions, streaming, logprobs), on 127.0.0.1.

  python -m transformer.serve --workdir runs/gpt-tiny-sft [--port 8000] [--max_batch 8]
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"messages": [{"role": "user", "content": "reverse cat"}], "temperature": 0}'

/v1/chat/completions needs a chat model (a run fine-tuned with the sft task, or a converted model with a
chat template); /v1/completions serves any language model (lm-eval's local-completions model scores through
it: echo and logprobs). Concurrent requests of the same prompt length and sampling are decoded as one batch
(transformer/inference/engine.py); a bad request is a 400 naming its field (transformer/inference/server.py).
"""

import os
import sys

from absl import flags

from transformer import cli


def main(argv):
    import uvicorn

    from transformer.inference import engine, server

    f = flags.FLAGS
    if f.max_batch < 1 or f.max_tokens < 1:
        raise ValueError(f"--max_batch={f.max_batch} and --max_tokens={f.max_tokens} must be at least 1")
    runner = engine.Engine.open(f.workdir, f.step, f.max_batch).start()
    name = f.name or os.path.basename(os.path.normpath(f.workdir))
    app = server.make_app(runner, name, server.Limits(f.max_prompt_tokens, f.max_tokens))
    print(f"serving {name} on http://{f.host}:{f.port}/v1 (chat: {'yes' if runner.chat else 'no'})", file=sys.stderr)
    uvicorn.run(app, host=f.host, port=f.port, log_level="warning")


if __name__ == "__main__":
    flags.DEFINE_string("workdir", None, "The run to serve.")
    flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface; mind who can reach it).")
    flags.DEFINE_integer("port", 8000, "Port to listen on.")
    flags.DEFINE_string("name", "", "The model's name in the API (default: the workdir's name).")
    flags.DEFINE_integer("max_batch", 8, "Requests decoded together at most.")
    flags.DEFINE_integer("max_prompt_tokens", 0, "Longest prompt accepted (0: the model's context less one).")
    flags.DEFINE_integer("max_tokens", 512, "Most new tokens of one answer.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.mark_flag_as_required("workdir")
    cli.run(main)
