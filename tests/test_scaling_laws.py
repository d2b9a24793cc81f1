"""Scaling-law fits: the IsoFLOP fit recovers the exponents of a known loss law, its bootstrap covers them under
noise, the IsoFLOP grid spends each budget by the model's own FLOPs, and the report reads a sweep's trials."""

import json
import math

import numpy as np
import pytest
from test_sweep import TINY

from transformer import config as config_lib
from transformer import rundir
from transformer.models import flops as flops_lib
from transformer.sweep import isoflop, scaling_laws
from transformer.training import shapes

# Chinchilla's fitted law (Hoffmann et al. 2022, eq. 10): L = E + A / N^alpha + B / D^beta, with C = 6 N D; its
# compute-optimal N grows as C^(beta / (alpha + beta)) and D as C^(alpha / (alpha + beta)).
E, A, B, ALPHA, BETA = 1.69, 406.4, 410.7, 0.34, 0.28


def law(n, d):
    return E + A / n ** ALPHA + B / d ** BETA


def synthetic(budgets, sizes_per_budget=7, noise=0.0, seed=0) -> list[scaling_laws.Point]:
    """Each budget swept over sizes log-spaced around (and offset from) its true optimum."""
    rng = np.random.default_rng(seed)
    a = BETA / (ALPHA + BETA)
    points = []
    for c in budgets:
        centre = (c / 6) ** a * rng.uniform(0.6, 1.6)  # the law's optimum is ~C^a up to a constant: off-centre
        for n in np.geomspace(centre / 8, centre * 8, sizes_per_budget):
            d = c / (6 * n)
            points.append(scaling_laws.Point(n, d, c, law(n, d) + noise * rng.standard_normal()))
    return points


def test_the_fit_recovers_the_exponents_of_a_known_law():
    fit = scaling_laws.fit_isoflops(synthetic([1e18, 1e19, 1e20, 1e21]))
    assert fit.a == pytest.approx(BETA / (ALPHA + BETA), abs=0.01)
    assert fit.b == pytest.approx(ALPHA / (ALPHA + BETA), abs=0.01)
    assert all(m.inside for m in fit.minima)
    n, d = fit.optimal(1e22)
    assert 6 * n * d == pytest.approx(1e22, rel=0.05)
    # the minimum of the true law at 1e22, found by brute force over N
    grid = np.geomspace(1e8, 1e12, 20001)
    assert n == pytest.approx(grid[np.argmin(law(grid, 1e22 / (6 * grid)))], rel=0.1)


def test_the_bootstrap_covers_the_true_exponent_under_noise():
    points = synthetic([1e18, 1e19, 1e20, 1e21], noise=0.005, seed=1)
    fit = scaling_laws.fit_isoflops(points)
    spread = scaling_laws.bootstrap(points, fit, target=1e22, resamples=300)
    low, high = spread.interval(spread.a)
    assert low < BETA / (ALPHA + BETA) < high and high - low < 0.2
    assert fit.params.stderr > 0 and len(spread.a) + spread.dropped == 300


def test_a_budget_without_a_minimum_is_left_out_and_a_single_budget_is_refused():
    falling = [scaling_laws.Point(n, 1e9 / n, 1e9, 3.0 - 0.01 * math.log(n) ** 2) for n in (1e3, 1e4, 1e5)]
    with pytest.raises(ValueError, match="do not bend up"):
        scaling_laws.budget_minimum(falling)
    fit = scaling_laws.fit_isoflops(falling + synthetic([1e18, 1e19, 1e20]))
    assert len(fit.minima) == 3 and len(fit.skipped) == 1 and "1e+09 FLOPs" in fit.skipped[0]
    assert "| left out | the budget of 1e+09" in scaling_laws.markdown(
        fit, scaling_laws.bootstrap(falling + synthetic([1e18, 1e19, 1e20]), fit, 1e21, 20), "eval/loss")
    with pytest.raises(ValueError, match="1 of 2 budgets have a minimum"):
        scaling_laws.fit_isoflops(falling + synthetic([1e18]))
    with pytest.raises(ValueError, match="1 compute budget"):
        scaling_laws.fit_isoflops(synthetic([1e18]))


SIZES = [{"model.d_model": d, "model.mlp_dim": 2 * d} for d in (16, 32, 64)]


def test_isoflop_grid_spends_each_budget_by_the_models_own_flops():
    config = config_lib.load(TINY)
    per_step = [isoflop.step_flops(config, s) for s in SIZES]
    assert per_step[0] < per_step[1] < per_step[2]
    trials = isoflop.grid(config, [1e9, 4e9], SIZES, extra=lambda steps: {"optim.warmup_steps": steps // 10})
    assert len(trials) == 6
    for trial, budget, cost in zip(trials, [1e9] * 3 + [4e9] * 3, per_step * 2):
        assert abs(trial["train.steps"] * cost - budget) <= cost / 2
        assert trial["optim.warmup_steps"] == trial["train.steps"] // 10
    assert [t["model.d_model"] for t in isoflop.grid(config, [1e9], SIZES, min_steps=round(1e9 / per_step[1]))] == [16,
                                                                                                                   32]
    with pytest.raises(ValueError, match="no size trains 10000 or more steps at budget 1e\\+09"):
        isoflop.grid(config, [1e9], SIZES, min_steps=10_000)


def test_the_report_fits_a_sweeps_trials_from_their_configs(tmp_path):
    """Trials as a sweep leaves them (config.json, metrics.jsonl, trial.json), their losses from the law."""
    base = config_lib.load(TINY)
    trials = isoflop.grid(base, [2e9, 6e9], SIZES)
    expected = {}
    for i, overrides in enumerate(trials):
        config = config_lib.load(TINY, [f"{k}={v}" for k, v in overrides.items()])
        config = shapes.resolved(config)
        forward, steps = flops_lib.forward_flops(config), overrides["train.steps"]
        n, d = forward["active"], forward["tokens"] * config.data.batch_size * steps
        directory = tmp_path / "trials" / f"t{i}"
        rundir.RunDir(str(directory)).write_config(config)
        (directory / "trial.json").write_text(json.dumps({"status": "done", "overrides": overrides}))
        (directory / "metrics.jsonl").write_text(json.dumps({"step": steps, "eval/loss": law(n, d)}) + "\n")
        expected[f"t{i}"] = (n, d, flops_lib.training_flops(config) * steps)
    points = scaling_laws.table(str(tmp_path))
    assert sorted(p.trial for p in points) == sorted(expected)
    for p in points:
        assert (p.params, p.tokens, p.flops) == pytest.approx(expected[p.trial])
    text = scaling_laws.write(str(tmp_path), target=1e11)
    assert "a = " in text and "At C = 1e+11 FLOPs" in text
    assert (tmp_path / "isoflops.png").stat().st_size > 0 and (tmp_path / "power_laws.png").stat().st_size > 0
