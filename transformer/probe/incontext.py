"""In-context learning, seen inside a causal model (Olsson et al. 2022, "In-context learning and induction
heads"): the in-context learning score and each head's induction score, over a run's checkpoints.

    run = probe.load("runs/gpt-tiny", step=400)
    losses = incontext.token_losses(run.model, run.params, tokens)        # [B, L - 1]
    incontext.icl_score(losses, early=(8, 16), late=(96, 127))            # late loss - early loss (nats)
    incontext.induction_scores(run.model, run.params, vocab=256, half=32)  # {layer path: [H]}
    incontext.over_checkpoints("runs/gpt-tiny", tokens)                    # both, at every checkpoint
    incontext.figure(history, "icl.png")                                   # the view a person reads

The score is the mean loss on late tokens of a context minus the mean loss on early ones: negative where
the model predicts better the more of the context it has read. A head's induction score is its mean
attention, over a sequence of random tokens repeated once, from each token of the repeat to the token after
that token's first occurrence (the head that lets a model copy what followed last time).

Glossary of shapes: B batch, L length, H heads, T the random half of an induction sequence.
"""

import jax
import jax.numpy as jnp
import numpy as np

from transformer import probe, rundir


def token_losses(model, params, tokens) -> np.ndarray:
    """tokens [B, L] -> each next token's cross entropy [B, L - 1] in float32 (nats)."""
    tokens = jnp.asarray(tokens)
    logits = model.apply({"params": params}, tokens[:, :-1])  # [B, L - 1, V]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -np.asarray(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0])


def icl_score(losses: np.ndarray, early: tuple[int, int], late: tuple[int, int]) -> float:
    """The mean loss [B, L - 1] over positions late[0]:late[1] minus over early[0]:early[1]."""
    return float(losses[:, late[0]:late[1]].mean() - losses[:, early[0]:early[1]].mean())


def induction_scores(model, params, vocab: int | np.ndarray, half: int, seed: int = 0,
                     rows: int = 4) -> dict[str, np.ndarray]:
    """{attention layer path: [H]}: each head's mean attention from position T + i to position i + 1 (the token
    after the first occurrence of the token at T + i), over `rows` sequences of T = `half` random tokens (ids
    below `vocab`, or drawn from the ids `vocab`: a model trained on a few bytes) repeated once. `model` must
    be in probe form (`probe.probe_form`: dense attention)."""
    rng = np.random.default_rng(seed)
    scores = {}
    for _ in range(rows):
        if np.isscalar(vocab):
            first = rng.integers(0, vocab, half)
        else:
            first = rng.choice(vocab, half, replace=len(vocab) < half)
        tokens = np.concatenate([first, first])[None].astype(np.int32)  # [1, 2T]
        for path, weights in probe.attention(model, params, tokens).items():  # [H, 2T, 2T]
            queries = np.arange(half, 2 * half - 1)
            picked = weights[:, queries, queries - half + 1].mean(-1)  # [H]
            scores[path] = scores.get(path, 0) + picked / rows
    return scores


def over_checkpoints(workdir: str, tokens: np.ndarray, early: tuple[int, int] | None = None,
                     late: tuple[int, int] | None = None, half: int | None = None,
                     alphabet: np.ndarray | None = None) -> list[dict]:
    """[{'step', 'icl_score', 'loss_by_position' [L - 1], 'induction' {layer: [H]}}] of each checkpoint of the
    run, scored on `tokens` [B, L] (documents of the run's kind of text); induction sequences draw from the ids
    `alphabet` (default: the whole vocabulary)."""
    length = tokens.shape[1] - 1
    early = early or (max(1, length // 16), max(2, length // 8))
    late = late or (length - length // 4, length)
    history = []
    for step in rundir.open(workdir).steps:
        run = probe.load(workdir, step)
        losses = token_losses(run.model, run.params, tokens)
        heads = induction_scores(run.model, run.params, run.model.vocab_size if alphabet is None else alphabet,
                                 half or min(32, run.model.max_len // 2))
        history.append({"step": step, "icl_score": icl_score(losses, early, late),
                        "loss_by_position": losses.mean(0).tolist(),
                        "induction": {k: v.tolist() for k, v in heads.items()}})
    return history


def figure(history: list[dict], path: str, title: str = "") -> None:
    """Three panels: the in-context learning score over training, the loss by position at each checkpoint,
    and each head's induction score over training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(steps, [h["icl_score"] for h in history], marker="o")
    axes[0].axhline(0, color="grey", lw=0.8)
    axes[0].set(title="in-context learning score", xlabel="step", ylabel="late-token loss - early-token loss (nats)")
    colours = plt.cm.viridis(np.linspace(0, 1, len(history)))
    for h, colour in zip(history, colours):
        axes[1].plot(h["loss_by_position"], color=colour, label=f"step {h['step']}")
    axes[1].set(title="loss by position in the context", xlabel="position", ylabel="loss (nats)")
    axes[1].legend(fontsize=7)
    for layer in history[-1]["induction"]:
        for head in range(len(history[-1]["induction"][layer])):
            axes[2].plot(steps, [h["induction"][layer][head] for h in history], marker=".",
                         label=f"{layer.split('/')[0]} head {head}")
    axes[2].set(title="induction score of each head", xlabel="step", ylabel="attention to the token after the "
                "previous occurrence")
    axes[2].legend(fontsize=6, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
