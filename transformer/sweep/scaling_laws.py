"""Scaling laws from an IsoFLOP sweep (Chinchilla's approach 2, Hoffmann et al. 2022, sec. 3.2): at each compute
budget C the loss as a quadratic in ln N, whose minimum is that budget's compute-optimal size N_opt(C) (and its
tokens D_opt(C), on the budget's own line of ln D against ln N); across budgets the power laws
N_opt = k_N C^a and D_opt = k_D C^b, fitted in log-log space.

    points = table(workdir, "eval/loss")   # a Point per finished trial: N, D, C from the run's own config
    fit = fit_isoflops(points)             # .minima (per budget), .a, .b, .optimal(C) -> (N, D)
    spread = bootstrap(points, fit)        # the exponents and the prediction over residual resamples

N is the parameters a token uses (all of a dense model), D the tokens trained on, C the training FLOPs of the
run (models/flops.py: 3 x the forward pass, the FLOPs formula the MFU reads). Trials are grouped into budgets by
their C (within a factor BUDGET_SPREAD of the group's smallest, since steps are whole). The uncertainty: the
standard errors of the two line fits (ordinary least squares over the budgets), and a bootstrap that
resamples the quadratics' pooled residuals (scaled up for the parameters they spent) onto every budget's
fitted losses and fits it all again. `write` draws the IsoFLOP curves and the power laws and writes
DIR/scaling.md (`python -m transformer.report DIR --scaling`).
"""

import dataclasses
import math
import os

import numpy as np

BUDGET_SPREAD = 1.25  # trials whose C lies within this factor of a budget's smallest are that budget's


@dataclasses.dataclass(frozen=True)
class Point:
    params: float  # N
    tokens: float  # D
    flops: float   # C
    loss: float
    trial: str = ""


@dataclasses.dataclass(frozen=True)
class Minimum:
    """A budget's quadratic loss = c2 (ln N)^2 + c1 ln N + c0 and its minimum."""
    budget: float
    coefficients: tuple[float, float, float]  # (c2, c1, c0)
    params: float
    tokens: float
    loss: float
    inside: bool  # the minimum lies within the sizes swept at that budget
    points: tuple[Point, ...]


@dataclasses.dataclass(frozen=True)
class Line:
    """ln y = slope ln C + intercept, and the slope's ordinary least-squares standard error (nan with 2 budgets)."""
    slope: float
    intercept: float
    stderr: float

    def __call__(self, flops):
        return np.exp(self.slope * np.log(flops) + self.intercept)


@dataclasses.dataclass(frozen=True)
class Fit:
    minima: tuple[Minimum, ...]
    params: Line  # N_opt(C)
    tokens: Line  # D_opt(C)
    skipped: tuple[str, ...] = ()  # why each budget without a minimum was left out

    @property
    def a(self) -> float:
        return self.params.slope

    @property
    def b(self) -> float:
        return self.tokens.slope

    def optimal(self, flops: float) -> tuple[float, float]:
        """The compute-optimal (N, D) at a budget of `flops`."""
        return float(self.params(flops)), float(self.tokens(flops))


def budgets(points: list[Point]) -> list[list[Point]]:
    """The points grouped by compute budget, smallest first."""
    groups = []
    for p in sorted(points, key=lambda p: p.flops):
        if groups and p.flops <= groups[-1][0].flops * BUDGET_SPREAD:
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def budget_minimum(points: list[Point], losses=None) -> Minimum:
    """The quadratic in ln N through a budget's points (their `losses` in place of theirs, where given) and its
    minimum; a ValueError where it has none (fewer than 3 sizes, or a curve that does not bend up)."""
    budget = math.exp(np.mean([math.log(p.flops) for p in points]))
    if len({p.params for p in points}) < 3:
        raise ValueError(f"the budget of {budget:.3g} FLOPs has {len({p.params for p in points})} model sizes: "
                         "a quadratic needs 3 or more")
    x = np.log([p.params for p in points])
    y = np.array([p.loss for p in points] if losses is None else losses, np.float64)
    c2, c1, c0 = np.polyfit(x, y, 2)
    if c2 <= 0:
        raise ValueError(f"the budget of {budget:.3g} FLOPs: its losses do not bend up over the sizes swept "
                         "(no minimum): sweep smaller and larger sizes around its best")
    best = -c1 / (2 * c2)
    slope, intercept = np.polyfit(x, np.log([p.tokens for p in points]), 1)  # the budget's ln D against ln N
    return Minimum(budget, (float(c2), float(c1), float(c0)), float(np.exp(best)),
                   float(np.exp(slope * best + intercept)), float(c0 - c1 * c1 / (4 * c2)),
                   bool(x.min() <= best <= x.max()), tuple(points))


def power_law(flops, values) -> Line:
    """ln values = slope ln flops + intercept by least squares, with the slope's standard error."""
    x, y = np.log(flops), np.log(values)
    slope, intercept = np.polyfit(x, y, 1)
    dof = len(x) - 2
    residual = y - (slope * x + intercept)
    stderr = math.sqrt(residual @ residual / dof / ((x - x.mean()) @ (x - x.mean()))) if dof > 0 else math.nan
    return Line(float(slope), float(intercept), stderr)


def fit_isoflops(points: list[Point], losses=None) -> Fit:
    """Each budget's minimum, then the power laws across the budgets that have one (a budget without is left
    out, its reason kept in `skipped`); a ValueError where fewer than 2 budgets have a minimum. `losses`, one per
    point in `points`' order, replaces their losses."""
    by_point = dict(zip(points, losses)) if losses is not None else None
    groups = budgets(points)
    if len(groups) < 2:
        raise ValueError(f"the trials span {len(groups)} compute budget: a power law needs 2 or more "
                         "(lay the sweep out with transformer.sweep.isoflop.grid)")
    minima, skipped = [], []
    for g in groups:
        try:
            minima.append(budget_minimum(g, None if by_point is None else [by_point[p] for p in g]))
        except ValueError as e:
            skipped.append(str(e))
    if len(minima) < 2:
        raise ValueError(f"{len(minima)} of {len(groups)} budgets have a minimum, a power law needs 2: "
                         + "; ".join(skipped))
    flops = [m.budget for m in minima]
    return Fit(tuple(minima), power_law(flops, [m.params for m in minima]),
               power_law(flops, [m.tokens for m in minima]), tuple(skipped))


@dataclasses.dataclass(frozen=True)
class Spread:
    """The bootstrap's samples, one per kept resample: the lines' slopes (the exponents) and intercepts, and the
    prediction at `target` (N, D)."""
    a: np.ndarray
    b: np.ndarray
    a_intercept: np.ndarray
    b_intercept: np.ndarray
    params: np.ndarray
    tokens: np.ndarray
    target: float
    dropped: int  # resamples in which a budget had no minimum

    @staticmethod
    def interval(samples: np.ndarray) -> tuple[float, float]:
        """The central 95% of the samples."""
        low, high = np.percentile(samples, [2.5, 97.5])
        return float(low), float(high)


def bootstrap(points: list[Point], fit: Fit, target: float, resamples: int = 1000, seed: int = 0) -> Spread:
    """The fit again on resampled losses: each point's fitted loss plus a residual drawn from all the budgets'
    quadratics' residuals, pooled and scaled by sqrt(n / (n - parameters)) for the 3 parameters each spent."""
    fitted = {p: float(np.polyval(m.coefficients, math.log(p.params))) for m in fit.minima for p in m.points}
    points = [p for m in fit.minima for p in m.points]  # the budgets the fit kept
    residuals = np.array([p.loss - fitted[p] for p in fitted])
    dof = len(residuals) - 3 * len(fit.minima)
    residuals *= math.sqrt(len(residuals) / dof) if dof > 0 else 1.0
    rng = np.random.default_rng(seed)
    base = np.array([fitted[p] for p in points])
    samples, dropped = [], 0
    for _ in range(resamples):
        try:
            again = fit_isoflops(points, base + rng.choice(residuals, len(points)))
        except ValueError:
            again = None
        if again is None or len(again.minima) != len(fit.minima):  # the same budgets as the fit, or none
            dropped += 1
            continue
        samples.append((again.a, again.b, again.params.intercept, again.tokens.intercept, *again.optimal(target)))
    if not samples:
        raise ValueError("no bootstrap resample has a minimum at every budget: the losses are too noisy for the "
                         "sizes swept")
    return Spread(*np.array(samples).T, target, dropped)


# A sweep's table, its report and figures -------------------------------------------------


def table(workdir: str, metric: str = "eval/loss") -> list[Point]:
    """A Point per done trial of the sweep in `workdir` that logged `metric`: N and the FLOPs of a step from the
    run's own config.json (models/flops.py), D and C over the steps it trained."""
    from transformer import rundir
    from transformer.models import flops as flops_lib
    from transformer.sweep import results

    points = []
    for row in results.collect(workdir, metric):
        if row["status"] != "done" or row.get(f"final {metric}") is None:
            continue
        config = rundir.open(results.trial_dir(workdir, row["trial"])).config
        forward = flops_lib.forward_flops(config)
        tokens = forward["tokens"] * config.data.batch_size * row["steps"]
        points.append(Point(float(forward["active"]), float(tokens), flops_lib.training_flops(config) * row["steps"],
                            float(row[f"final {metric}"]), row["trial"]))
    return points


def markdown(fit: Fit, spread: Spread, metric: str) -> str:
    n, d = fit.optimal(spread.target)
    (a_low, a_high), (b_low, b_high) = spread.interval(spread.a), spread.interval(spread.b)
    (n_low, n_high), (d_low, d_high) = spread.interval(spread.params), spread.interval(spread.tokens)
    kept = len(spread.a)
    lines = ["# Scaling laws (IsoFLOP minima, then power laws)", "",
             f"{metric} against N at each budget, fitted by a quadratic in ln N (isoflops.png); its minimum is the "
             "budget's compute-optimal N, and D on the budget's own line of ln D against ln N.", "",
             "| budget C (FLOPs) | trials | N_opt | D_opt | D/N | loss at the minimum | inside the sizes swept |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {m.budget:.3g} | {len(m.points)} | {m.params:,.0f} | {m.tokens:,.0f} | {m.tokens / m.params:.3g} | "
              f"{m.loss:.4g} | {'yes' if m.inside else 'no: widen the sizes'} |" for m in fit.minima]
    lines += [f"| left out | {reason} |||||" for reason in fit.skipped]
    lines += ["", "Power laws across the budgets (power_laws.png), with the slopes' least-squares standard errors "
              f"and the central 95% of {kept} bootstrap fits (residuals resampled"
              + (f"; {spread.dropped} resamples without a minimum at some budget left out" if spread.dropped else "")
              + "):", "",
              f"- N_opt = {math.exp(fit.params.intercept):.4g} C^a, a = {fit.a:.3f} ± {fit.params.stderr:.3f} "
              f"(bootstrap {a_low:.3f} to {a_high:.3f})",
              f"- D_opt = {math.exp(fit.tokens.intercept):.4g} C^b, b = {fit.b:.3f} ± {fit.tokens.stderr:.3f} "
              f"(bootstrap {b_low:.3f} to {b_high:.3f})",
              f"- a + b = {fit.a + fit.b:.3f} (1 where C is proportional to N x D)", "",
              f"At C = {spread.target:.3g} FLOPs: N_opt = {n:,.0f} (bootstrap {n_low:,.0f} to {n_high:,.0f}), "
              f"D_opt = {d:,.0f} tokens ({d_low:,.0f} to {d_high:,.0f}), {d / n:.3g} tokens per parameter."]
    return "\n".join(lines) + "\n"


def plot(fit: Fit, spread: Spread, workdir: str, metric: str) -> None:
    """DIR/isoflops.png (the loss against N per budget, its quadratic and minimum) and DIR/power_laws.png
    (N_opt and D_opt against C, the fitted lines out to the target and the bootstrap's 95% band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for m, colour in zip(fit.minima, plt.cm.viridis(np.linspace(0, 0.85, len(fit.minima)))):
        x = np.log([p.params for p in m.points])
        ax.scatter(np.exp(x), [p.loss for p in m.points], color=colour, label=f"C = {m.budget:.2g}")
        grid = np.linspace(x.min() - 0.2, x.max() + 0.2, 100)
        ax.plot(np.exp(grid), np.polyval(m.coefficients, grid), color=colour)
        ax.scatter([m.params], [m.loss], color=colour, marker="*", s=150, edgecolor="black", zorder=3)
    ax.set_xscale("log")
    ax.set(xlabel="parameters N", ylabel=metric, title="IsoFLOP curves (star: each budget's minimum)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "isoflops.png"), dpi=100)
    plt.close(fig)

    flops = np.array([m.budget for m in fit.minima])
    span = np.geomspace(flops.min() / 1.5, max(flops.max() * 1.5, spread.target), 50)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, line, name, found, lines in (
            (axes[0], fit.params, "N_opt", [m.params for m in fit.minima], zip(spread.a, spread.a_intercept)),
            (axes[1], fit.tokens, "D_opt", [m.tokens for m in fit.minima], zip(spread.b, spread.b_intercept))):
        ax.scatter(flops, found, color="black", zorder=3, label="the budgets' minima")
        ax.plot(span, line(span), label=f"{name} ∝ C^{line.slope:.3f}")
        band = np.percentile([Line(s, i, math.nan)(span) for s, i in lines], [2.5, 97.5], axis=0)
        ax.fill_between(span, band[0], band[1], alpha=0.25, label="bootstrap 95%")
        ax.axvline(spread.target, color="grey", linestyle=":")
        ax.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel=name)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "power_laws.png"), dpi=100)
    plt.close(fig)


def write(workdir: str, metric: str = "eval/loss", target: float = 0.0) -> str:
    """Fits the sweep in `workdir`, writes DIR/scaling.md, isoflops.png and power_laws.png; returns the markdown.
    `target`: the budget to predict for (0: 10 x the largest swept)."""
    points = table(workdir, metric)
    fit = fit_isoflops(points)
    spread = bootstrap(points, fit, target or 10 * max(m.budget for m in fit.minima))
    text = markdown(fit, spread, metric)
    with open(os.path.join(workdir, "scaling.md"), "w") as f:
        f.write(text)
    plot(fit, spread, workdir, metric)
    return text
