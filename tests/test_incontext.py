"""The in-context learning probe: per-token losses are the model's own cross entropies, the score compares
late with early positions, and an induction head's score reads the right attention entries."""

import jax
import numpy as np
from test_harness import random_run

from transformer import probe
from transformer.probe import incontext


def test_token_losses_and_the_icl_score(tmp_path):
    run = probe.load(random_run(tmp_path / "run"))
    tokens = np.random.default_rng(0).integers(0, 256, (2, 33)).astype(np.int32)
    losses = incontext.token_losses(run.model, run.params, tokens)
    theirs = run.model.apply({"params": run.params}, tokens[:, :-1], targets=tokens[:, 1:])
    np.testing.assert_allclose(losses, np.asarray(theirs), atol=1e-5)
    assert incontext.icl_score(losses, (0, 4), (28, 32)) == np.float32(losses[:, 28:32].mean() - losses[:, :4].mean())


def test_induction_scores_read_the_token_after_the_previous_occurrence(monkeypatch):
    half = 8
    perfect = np.zeros((2, 2 * half, 2 * half))  # head 0 attends as an induction head, head 1 to itself
    for q in range(2 * half):
        perfect[0, q, q - half + 1 if q >= half else 0] = 1.0
        perfect[1, q, q] = 1.0
    monkeypatch.setattr(probe, "attention", lambda model, params, tokens: {"block_0/attn": perfect})
    scores = incontext.induction_scores(None, None, vocab=50, half=half, rows=2)
    np.testing.assert_allclose(scores["block_0/attn"], [1.0, 0.0])
    assert jax.tree.leaves(scores)


def test_induction_sequences_draw_from_the_given_ids(monkeypatch):
    seen = []
    monkeypatch.setattr(probe, "attention", lambda model, params, tokens: seen.append(tokens) or
                        {"block_0/attn": np.ones((1, 8, 8)) / 8})
    incontext.induction_scores(None, None, vocab=np.array([97, 98, 99, 100, 101]), half=4, rows=3)
    assert set(np.concatenate(seen).ravel()) <= {97, 98, 99, 100, 101}
    assert all(len(set(t[0, :4])) == 4 for t in seen)  # the first half repeats no id: one previous occurrence
