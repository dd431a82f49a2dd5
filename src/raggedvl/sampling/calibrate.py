"""Calibrate the cost model's coefficients from measured per-sample times.

The cost model is linear in its coefficients (``raggedvl.batch.costs``): t_hat = F @ w with
features F [N, 4] = (1, sum P, sum P**2, L). ``fit_cost_model`` solves non-negative least
squares min ||D (F w - t)||^2 subject to w >= 0, where D = diag(1 / t) by default (relative
errors: a 10 ms sample matters as much as a 1 s one, which is what balance needs). With four
unknowns the exact NNLS solution is found by enumerating supports: at the optimum the
coefficients off the support are zero and those on it are the unconstrained least-squares
solution on those columns (the Karush-Kuhn-Tucker conditions of NNLS, Lawson & Hanson 1974,
"Solving Least Squares Problems", ch. 23), so the best non-negative support solution is it.

``calibrate`` times a user-supplied callable per sample (e.g. the model's forward + backward on
a one-sample batch), fits on alternate samples and reports the mean absolute relative error on
the held-out ones. Shapes: N samples; times in seconds; features float64.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from raggedvl.batch.costs import FEATURES, CostModel


def fit_cost_model(
    features: np.ndarray,
    times: Sequence[float],
    *,
    fit: Sequence[str] = FEATURES,
    relative: bool = True,
) -> CostModel:
    """Non-negative least-squares coefficients (seconds per feature unit) -> ``CostModel``.

    ``features`` [N, 4] in ``FEATURES`` order, ``times`` [N] seconds (> 0 with ``relative``);
    coefficients not named in ``fit`` are fixed at 0. Raises ``ValueError`` for mismatched
    shapes, an unknown feature name, non-positive times or fewer samples than fitted features.
    """
    f = np.asarray(features, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if f.ndim != 2 or f.shape[1] != len(FEATURES) or t.shape != (f.shape[0],):
        raise ValueError(f"features must be [N, {len(FEATURES)}] and times [N]; got {f.shape} and {t.shape}")
    unknown = [name for name in fit if name not in FEATURES]
    if unknown:
        raise ValueError(f"unknown features {unknown}; choose from {FEATURES}")
    cols = [FEATURES.index(name) for name in fit]
    if len(t) < len(cols):
        raise ValueError(f"{len(t)} timed samples cannot fit {len(cols)} coefficients; time more samples")
    if not np.all(np.isfinite(t)) or (relative and np.any(t <= 0)):
        raise ValueError(f"times must be finite and > 0 seconds; got min {t.min()!r}")
    weight = 1.0 / t if relative else np.ones_like(t)
    a, b = f * weight[:, None], t * weight
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    best_w, best_res = np.zeros(len(FEATURES)), float(np.sum(b * b))
    for k in range(1, len(cols) + 1):
        for support in itertools.combinations(cols, k):
            sol, *_ = np.linalg.lstsq(a[:, support], b, rcond=None)
            if np.any(sol < 0):
                continue
            res = float(np.sum((a[:, support] @ sol - b) ** 2))
            if res < best_res:
                best_res = res
                best_w = np.zeros(len(FEATURES))
                best_w[list(support)] = sol
    return CostModel.from_coefficients((best_w / scale).tolist())


def measure_times(
    run: Callable[[Any], Any], items: Sequence[Any], *, repeats: int = 3, warmup: int = 1, reduce: str = "median"
) -> np.ndarray:
    """[N] wall-clock seconds of ``run(item)``: the median (or, with ``reduce="min"``, the
    minimum: the best estimate of uncontended time on a shared machine) over ``repeats`` calls,
    after ``warmup`` untimed calls on the first item (allocator and kernel warm-up). The items
    are timed round-robin, ``repeats`` passes over all of them."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if reduce not in ("median", "min"):
        raise ValueError(f"reduce must be 'median' or 'min', got {reduce!r}")
    for _ in range(warmup if items else 0):
        run(items[0])
    samples = np.empty((repeats, len(items)))
    for rep in range(repeats):  # round-robin: a burst of load on a shared machine hits all items
        for i, item in enumerate(items):
            start = time.perf_counter()
            run(item)
            samples[rep, i] = time.perf_counter() - start
    return np.median(samples, axis=0) if reduce == "median" else samples.min(axis=0)


def relative_errors(predicted: Sequence[float], measured: Sequence[float]) -> np.ndarray:
    """[N] |predicted - measured| / measured."""
    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    return np.abs(p - m) / m


@dataclass(frozen=True)
class CalibrationResult:
    """``cost_model`` fitted on the even-indexed samples; ``measured`` and ``predicted`` [N]
    seconds for all samples; ``heldout_error`` the mean absolute relative error on the
    odd-indexed (held-out) samples, ``fit_error`` on the fitted ones."""

    cost_model: CostModel
    measured: np.ndarray
    predicted: np.ndarray
    fit_error: float
    heldout_error: float


def calibrate(
    run: Callable[[Any], Any],
    items: Sequence[Any],
    features: np.ndarray,
    *,
    fit: Sequence[str] = FEATURES,
    repeats: int = 3,
    warmup: int = 1,
    reduce: str = "median",
) -> CalibrationResult:
    """Time ``run(item)`` for each item, fit the cost model, report held-out accuracy.

    ``features`` [N, 4] for the items (``raggedvl.batch.costs.cost_features`` or
    ``estimate_costs(...).features``). Needs N >= 2 * len(fit) (``ValueError`` otherwise).
    """
    f = np.asarray(features, dtype=np.float64)
    if len(items) != f.shape[0]:
        raise ValueError(f"{len(items)} items but features has {f.shape[0]} rows; give one row per item")
    if len(items) < 2 * len(fit):
        raise ValueError(f"calibration needs >= {2 * len(fit)} items (half are held out), got {len(items)}")
    measured = measure_times(run, items, repeats=repeats, warmup=warmup, reduce=reduce)
    model = fit_cost_model(f[0::2], measured[0::2], fit=fit)
    predicted = f @ model.coefficients.numpy()
    errors = relative_errors(predicted, measured)
    return CalibrationResult(model, measured, predicted, float(errors[0::2].mean()), float(errors[1::2].mean()))
