"""The OpenAI-compatible server on loopback, driven by the official openai client and httpx: chat (streaming
and not, n choices), completions with echo and logprobs (non-UTF-8 tokens as OpenAI writes them), the API key;
malformed, oversized and out-of-range requests, a long request beside a short one, tokenizing off the event
loop, a client leaving mid-stream; the command's port check, access log and SIGTERM."""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import httpx
import numpy as np
import pytest
from conftest import FAST_COMPILES
from test_chat import chat_run  # noqa: F401 (a fixture)
from test_sft import pretrained  # noqa: F401 (a fixture)

from transformer import rundir
from transformer.data.text import tokenizers
from transformer.inference import engine as engine_lib
from transformer.inference import protocol, scoring, server
from transformer.training.tasks import sft

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = server.Limits(max_prompt_tokens=60, max_tokens=8, max_choices=8)  # the model's context: 64
LONG = 11  # the prompt length of the long request's choices
WAIT = 180  # seconds a step waits for another thread at most (a bound, never a measurement)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(chat_run):  # noqa: F811
    runner = engine_lib.Engine.open(chat_run, max_batch=8).start()
    port = free_port()
    app = server.make_app(runner, "tiny", LIMITS, api_key=KEY)
    instance = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    for _ in range(400):
        if instance.started:
            break
        time.sleep(0.05)
    yield runner, f"http://127.0.0.1:{port}/v1", instance
    instance.should_exit = True
    thread.join(timeout=10)


def test_openai_client_chats_streams_and_scores(served, chat_run):  # noqa: F811
    runner, url, _ = served
    client = openai.OpenAI(base_url=url, api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong").models.list()
    messages = [{"role": "user", "content": "reverse cat"}]
    run = rundir.open(chat_run)
    want = sft.reply(run.model(), run.restore_params(), run.chat_format(), messages, 8)
    answer = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=8, n=2)
    assert [c.message.content for c in answer.choices] == [want, want] and answer.choices[1].index == 1
    streamed = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=8,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want
    scored = client.completions.create(model="tiny", prompt="reverse café", max_tokens=1, temperature=0, echo=True,
                                       logprobs=20)
    lp = scored.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len("reverse café".encode()) + 1
    assert lp.tokens[-3:-1] == ["bytes:\\xc3", "bytes:\\xa9"]  # é's two bytes, each not UTF-8 alone
    assert all(len(top) == 20 for top in lp.top_logprobs[1:])  # 20 distinct keys: no two tokens collapse
    ids = runner.text_ids("reverse café")
    chosen, _ = runner.call(lambda: scoring.token_logprobs(runner.model, runner.params, ids, 0))
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], chosen, atol=1e-5)
    assert all(max(top.values()) >= value - 1e-6 for top, value in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))


def test_logprob_keys_of_a_byte_level_bpe_write_a_part_of_a_character_as_its_bytes():
    bpe = tokenizers.train_bpe(["café crème " * 20], 300)
    engine = types.SimpleNamespace(chat=None, tokenizer=bpe, token_text=lambda t: "")  # the engine's text past its ids
    alone = {b: bpe.tokenizer.token_to_id(c) for b, c in tokenizers.byte_characters().items()}
    assert [protocol.token_key(engine, alone[b]) for b in (0xC3, 0xA9, ord("c"))] == ["bytes:\\xc3", "bytes:\\xa9", "c"]
    assert protocol.token_key(engine, bpe.tokenizer.token_to_id("Ã©")) == "é"  # é's two bytes merged: whole
    assert protocol.token_key(engine, 10_000) == "token_id:10000"


def test_bad_requests_are_answered_in_one_line_and_the_server_keeps_serving(served):
    runner, url, _ = served
    say = [{"role": "user", "content": "x"}]
    cases = [("/chat/completions", {"messages": []}, "messages"),
             ("/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
             ("/chat/completions", {"messages": say, "temperature": -1}, "temperature"),
             ("/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}', "top_p"),
             ("/chat/completions", {"messages": [{"role": "user", "content": "x" * 100}]}, "messages"),
             ("/chat/completions", {"messages": say, "max_tokens": 1000}, "max_tokens"),
             ("/chat/completions", {"messages": say, "max_tokens": 2**80}, "max_tokens"),
             ("/chat/completions", {"messages": say, "seed": 2**80}, "seed"),
             ("/chat/completions", {"messages": say, "n": 9}, "n"),
             ("/chat/completions", {"messages": say, "stop": ["x"] * 100}, "stop"),
             ("/completions", {"prompt": ["a"] * 200, "max_tokens": 16}, "prompt"),
             ("/completions", {"prompt": "a", "logprobs": 2**80}, "logprobs"),
             ("/completions", {"prompt": [999999]}, "prompt"),
             ("/completions", {"prompt": [1] * 60, "max_tokens": 8}, "max_tokens")]
    with httpx.Client(base_url=url, timeout=WAIT, headers=AUTH) as http:
        for path, body, param in cases:
            r = http.post(path, **{"content" if isinstance(body, bytes) else "json": body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
            assert "\n" not in r.json()["error"]["message"]
        assert "this server's 8 choices" in http.post("/completions", json=cases[10][1]).json()["error"]["message"]
        assert "at most 4" in http.post("/completions", json=cases[-1][1]).json()["error"]["message"]
        r = http.post("/completions", content=b'{"prompt": "a",\n "max_tokens": 1,, }')
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("invalid JSON at character 33")
        limit = server.Served(runner, "tiny", LIMITS).body_bytes
        for content in (json.dumps({"prompt": "x" * 2_000_000}).encode(), iter([b" " * limit, b"{}"])):
            r = http.post("/completions", content=content)  # a length given, then chunks without one
            assert r.status_code == 400 and f"more than this server's {limit}" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/models").status_code == 401
        batches = runner.batches
        body = {"messages": [{"role": "user", "content": "reverse dog"}], "temperature": 0, "max_tokens": 6}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: http.post("/chat/completions", json=body), range(8)))
        assert all(a.status_code == 200 for a in answers)
        assert len({a.json()["choices"][0]["message"]["content"] for a in answers}) == 1
        assert runner.batches - batches < 8  # some were decoded together
        assert http.get("/models").status_code == 200


def test_a_long_request_does_not_starve_a_short_one_nor_tokenizing_the_event_loop(served, monkeypatch):
    runner, url, _ = served
    (started, short_in, release), done, released = (threading.Event() for _ in range(3)), [], []
    stream, submit, text_ids = runner.stream, runner.submit, runner.text_ids

    def watched_submit(job):
        submit(job)
        if hasattr(job, "ids"):
            (started if len(job.ids) == LONG else short_in).set()

    def watched_stream(ids, *args):
        """The engine's tokens; a long choice's first one read only once the short request is in the engine."""
        inner = stream(ids, *args)
        if len(ids) == LONG:
            first = next(inner)
            short_in.wait(WAIT)
            yield first
        yield from inner

    def held_text_ids(text):
        if text == "hold":
            released.append(release.wait(WAIT))  # False where /v1/models could not answer meanwhile
        return text_ids(text)
    monkeypatch.setattr(runner, "steps", 2)  # the long's second wave takes 4 decode calls, the short 2
    monkeypatch.setattr(runner, "stream", watched_stream)
    monkeypatch.setattr(runner, "submit", watched_submit)
    monkeypatch.setattr(runner, "text_ids", held_text_ids)
    with httpx.Client(base_url=url, timeout=WAIT, headers=AUTH) as http:
        def ask(name, path, body):
            assert http.post(path, json=body).status_code == 200
            done.append(name)
        held = threading.Thread(target=ask, args=("held", "/completions", {"prompt": "hold", "max_tokens": 0}))
        held.start()
        assert http.get("/models").status_code == 200  # while a prompt is being tokenized
        release.set()
        held.join(WAIT)
        long = {"prompt": [[1] * LONG] * 8, "max_tokens": 8, "temperature": 0}
        thread = threading.Thread(target=ask, args=("long", "/completions", long))
        thread.start()
        assert started.wait(WAIT)
        ask("short", "/chat/completions", {"messages": [{"role": "user", "content": "reverse sun"}], "max_tokens": 4})
        thread.join(WAIT)
    assert released == [True] and done == ["held", "short", "long"]


def test_a_client_leaving_mid_stream_frees_its_generation(served, monkeypatch):
    runner, url, instance = served
    stream, release, closed, written = runner.stream, threading.Event(), threading.Event(), []

    def held_stream(*args, **kwargs):
        try:
            for token in stream(*args, **kwargs):
                written.append(token)
                yield token
                release.wait(WAIT)
        except GeneratorExit:
            closed.set()  # closed by its reader before its end: the engine's row is freed
            raise
    monkeypatch.setattr(runner, "stream", held_stream)
    body = {"messages": [{"role": "user", "content": "reverse box"}], "max_tokens": 8, "temperature": 0,
            "stream": True}
    with httpx.Client(base_url=url, timeout=WAIT, headers=AUTH) as http:
        with http.stream("POST", "/chat/completions", json=body) as r:
            assert next(r.iter_lines()).startswith("data: ")
            connections = len(instance.server_state.connections)
        for _ in range(WAIT * 20):  # until the server has seen the client leave
            if len(instance.server_state.connections) < connections:
                break
            time.sleep(0.05)
        release.set()
        assert closed.wait(WAIT) and len(written) < 8
        monkeypatch.setattr(runner, "stream", stream)
        assert http.post("/chat/completions", json={**body, "stream": False}).status_code == 200


def serve_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "transformer.serve", *flags]


ENV = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_COMPILES}


def test_a_busy_port_fails_in_one_line_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(serve_command("--workdir", str(tmp_path / "none"), "--port", str(port)), env=ENV,
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use;"
                                                  " choose another --port or --host"]


@pytest.mark.slow
def test_the_command_asks_its_key_logs_each_request_and_stops_on_sigterm(chat_run):  # noqa: F811
    port = free_port()
    proc = subprocess.Popen(serve_command("--workdir", chat_run, "--port", str(port), "--api_key", KEY,
                                          "--access_log"), env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/models", headers=AUTH, timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                assert proc.poll() is None
                time.sleep(0.2)
        assert httpx.get(f"{url}/models", timeout=5).status_code == 401
        with httpx.Client(base_url=url, timeout=WAIT, headers=AUTH) as http:
            with http.stream("POST", "/completions", json={"prompt": "reverse", "max_tokens": 8, "stream": True}):
                proc.send_signal(signal.SIGTERM)  # a stream in flight
                sent = time.monotonic()
                proc.wait(timeout=30)
                print(f"stopped {time.monotonic() - sent:.1f} s after SIGTERM")
    finally:
        proc.kill()
        log = proc.stdout.read()
    assert '"GET /v1/models HTTP/1.1" 200' in log and '"GET /v1/models HTTP/1.1" 401' in log, log
