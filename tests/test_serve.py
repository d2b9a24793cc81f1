"""The OpenAI-compatible server on loopback, driven by the official openai client: chat (streaming and not),
completions with echo and logprobs, malformed, oversized and concurrent requests; it stops by itself."""

import concurrent.futures
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from test_chat import chat_run  # noqa: F401 (a fixture)
from test_sft import pretrained  # noqa: F401 (a fixture)

from transformer import rundir
from transformer.data.text import chat_templates as templates
from transformer.inference import engine as engine_lib
from transformer.inference import server
from transformer.training.tasks import sft

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def served(chat_run):  # noqa: F811
    runner = engine_lib.Engine.open(chat_run, max_batch=8).start()
    app = server.make_app(runner, "tiny", server.Limits(max_prompt_tokens=40, max_tokens=8))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    instance = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    for _ in range(200):
        if instance.started:
            break
        time.sleep(0.05)
    yield runner, f"http://127.0.0.1:{port}/v1"
    instance.should_exit = True
    thread.join(timeout=10)


def test_openai_client_chats_streams_and_scores(served, chat_run):  # noqa: F811
    runner, url = served
    client = openai.OpenAI(base_url=url, api_key="none")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "reverse cat"}]
    run = rundir.open(chat_run)
    want = sft.reply(run.model(), run.restore_params(), templates.for_run(chat_run), messages, 8)
    answer = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=8)
    assert answer.choices[0].message.content == want
    streamed = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=8,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want
    scored = client.completions.create(model="tiny", prompt="reverse cat", max_tokens=1, temperature=0, echo=True,
                                       logprobs=2)
    lp = scored.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len("reverse cat") + 1
    ids = runner.text_ids("reverse cat")
    chosen, _ = runner.score(ids, 0)
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], chosen, atol=1e-5)
    assert all(max(top.values()) >= value - 1e-6 for top, value in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))


def test_bad_requests_are_answered_and_the_server_keeps_serving(served):
    runner, url = served
    cases = [({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
             ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
             ({"messages": [{"role": "user", "content": "x" * 100}]}, "messages"),
             ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000}, "max_tokens")]
    with httpx.Client(base_url=url, timeout=60) as http:
        for body, param in cases:
            r = http.post("/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        r = http.post("/completions", content=b"{not json")
        assert r.status_code == 400
        r = http.post("/completions", json={"prompt": [999999]})
        assert r.status_code == 400 and "999999" in r.json()["error"]["message"]
        batches = runner.batches
        body = {"messages": [{"role": "user", "content": "reverse dog"}], "temperature": 0, "max_tokens": 6}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: http.post("/chat/completions", json=body), range(8)))
        assert all(a.status_code == 200 for a in answers)
        assert len({a.json()["choices"][0]["message"]["content"] for a in answers}) == 1
        assert runner.batches - batches < 8  # some were decoded together
        assert http.get("/models").status_code == 200
