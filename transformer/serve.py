"""Serve a run over HTTP with OpenAI's API (chat and completions, streaming, logprobs), on 127.0.0.1.

  python -m transformer.serve --workdir runs/gpt-tiny-sft [--port 8000] [--max_batch 8] [--api_key KEY]
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"messages": [{"role": "user", "content": "reverse cat"}], "temperature": 0}'

/v1/chat/completions needs a chat model (a run fine-tuned with the sft task, or a converted model with a
chat template); /v1/completions serves any language model (lm-eval's local-completions model scores through
it: echo and logprobs). It listens on 127.0.0.1 (this machine alone) unless --host says otherwise; with
--api_key (or $TRANSFORMER_API_KEY) a request without `Authorization: Bearer KEY` is refused 401. The port is
taken before the model loads (a busy one fails at once); the engine's programs are compiled before it listens
(--nowarm: on first need); SIGTERM or Ctrl-C stops the server within a few seconds, ending the requests in
flight. The engine decodes concurrent requests together
(transformer/inference/engine.py); a bad request is a 400 naming its field (transformer/inference/server.py).
"""

import os
import socket
import sys
import time

from absl import flags

from transformer import cli

STOP_SECONDS = 3  # how long requests in flight may finish after SIGTERM
KEY_VARIABLE = "TRANSFORMER_API_KEY"  # the API key where --api_key is not given (out of `ps`'s sight)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not yet listening), or one line naming --port where it is taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        cli.fail(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port or --host")
    sock.set_inheritable(True)
    return sock


def main(argv):
    f = flags.FLAGS
    for name in ("max_batch", "max_tokens", "max_choices"):
        if f[name].value < 1:
            raise ValueError(f"--{name}={f[name].value} must be at least 1")
    sock = bind(f.host, f.port)  # before the imports and the model: a busy port costs a second
    api_key = f.api_key or os.environ.get(KEY_VARIABLE, "")
    import logging

    import uvicorn

    from transformer.inference import engine, server

    runner = engine.Engine.open(f.workdir, f.step, f.max_batch)
    if f.warm:
        started = time.perf_counter()
        print("compiling the engine's programs (--nowarm: as requests need them)", file=sys.stderr, flush=True)
        runner.warm()
        print(f"compiled {runner.programs} programs in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    runner.start()
    name = f.name or os.path.basename(os.path.normpath(f.workdir))
    app = server.make_app(runner, name, server.Limits(f.max_prompt_tokens, f.max_tokens, f.max_choices),
                          api_key=api_key)
    config = uvicorn.Config(app, log_level="warning", access_log=f.access_log,
                            timeout_graceful_shutdown=STOP_SECONDS)
    if f.access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    print(f"serving {name} on http://{f.host}:{f.port}/v1 (chat: {'yes' if runner.chat else 'no'}; API key: "
          f"{'yes' if api_key else 'none'})", file=sys.stderr)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    flags.DEFINE_string("workdir", None, "The run to serve.")
    flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface, so anyone who can "
                        "reach this machine can use the model; give --api_key).")
    flags.DEFINE_integer("port", 8000, "Port to listen on.")
    flags.DEFINE_string("name", "", "The model's name in the API (default: the workdir's name).")
    flags.DEFINE_string("api_key", "", "Refuse (401) requests without the header 'Authorization: Bearer KEY' "
                        f"(default: ${KEY_VARIABLE}, else none asked).")
    flags.DEFINE_bool("access_log", False, "Print a line for each request (client, method, path, status).")
    flags.DEFINE_integer("max_batch", 8, "Requests decoded together at most.")
    flags.DEFINE_bool("warm", True, "Compile every program a request may need before listening (no request then "
                      "waits for a compile: a prompt of a new length, a new number of requests at once).")
    flags.DEFINE_integer("max_prompt_tokens", 0, "Longest prompt accepted (0: the model's context less one).")
    flags.DEFINE_integer("max_tokens", 512, "Most new tokens of one answer.")
    flags.DEFINE_integer("max_choices", 16, "Most answers of one request (prompts times n).")
    cli.define_step()
    flags.mark_flag_as_required("workdir")
    cli.run(main)
