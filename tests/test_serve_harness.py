"""lm-eval's `local-completions` model scores a local multiple-choice task through `serve` on loopback with
the log-likelihoods and accuracy of the direct harness model (`RunLM`) on the same run."""

import socket
import threading
import time

import numpy as np
import pytest
from test_harness import local_task, random_run

lm_eval = pytest.importorskip("lm_eval")
uvicorn = pytest.importorskip("uvicorn")

from transformer.inference import engine as engine_lib  # noqa: E402
from transformer.inference import harness, scoring, server  # noqa: E402


def serving(runner):
    """(the uvicorn server of `runner` on a free loopback port, its thread, the port), started."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = server.make_app(runner, "tiny", server.Limits(max_tokens=8))
    instance = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    for _ in range(400):
        if instance.started:
            break
        time.sleep(0.05)
    assert instance.started
    return instance, thread, port


def per_choice(results, task):
    """[log-likelihood of each choice of each document], in document order."""
    docs = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return np.array([[resp[0] for resp in sample["filtered_resps"]] for sample in docs], np.float64)


@pytest.mark.slow
def test_local_completions_through_the_server_scores_as_the_harness_model(tmp_path):
    workdir = random_run(tmp_path / "run")
    folder = local_task(tmp_path / "tasks", docs=8)
    manager = harness.task_manager(folder)
    scorer = scoring.Scorer.from_run(workdir, None, 8)
    direct = lm_eval.simple_evaluate(model=harness.RunLM(scorer=scorer), tasks=["sums_mc"], task_manager=manager,
                                     log_samples=True, bootstrap_iters=0, verbosity="WARNING")
    runner = engine_lib.Engine.open(workdir).start()
    instance, thread, port = serving(runner)
    try:
        from lm_eval.models.openai_completions import LocalCompletionsAPI

        args = {"base_url": f"http://127.0.0.1:{port}/v1/completions", "model": "tiny", "max_length": 64,
                "custom_prefix_token_id": scorer.prefix_id, "max_retries": 1}
        served = lm_eval.simple_evaluate(model=LocalCompletionsAPI(**args), tasks=["sums_mc"],
                                         task_manager=manager, log_samples=True, bootstrap_iters=0,
                                         verbosity="WARNING")
    finally:
        instance.should_exit = True
        thread.join(timeout=10)
    want, got = per_choice(direct, "sums_mc"), per_choice(served, "sums_mc")
    assert want.shape == got.shape == (8, 3)
    print(f"max |log-likelihood difference| {np.abs(want - got).max():.2e}")
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert served["results"]["sums_mc"]["acc,none"] == direct["results"]["sums_mc"]["acc,none"]
