"""L-GreCo's dynamic-programming solver (Algorithm 1 of the L-GreCo paper), vectorised.

Pick one candidate per layer: least total size with total error <= budget. Errors are counted in
units of delta = budget / steps, rounded up; for every total j <= steps of units the DP keeps the
least size of the layers so far with at most j units: row[j] = min_c prev[j - units[c]] + size[c],
a min over shifted copies of the previous row (dominated candidates dropped, and only totals that
are reachable and leave room for the remaining layers kept). The result is optimal for the rounded
errors, hence feasible for the true budget (rounding up never understates an error) and no larger
than the true optimum for the tightened budget - L * delta (rounding adds under delta per layer).
Ties are deterministic: least size, then least total units, then the lowest candidate index,
choosing from the last layer back.
"""

from fractions import Fraction
import math
import numbers

import numpy as np


def solve(sizes, errors, budget, steps=10000):
    """Returns (choice, total_size, total_error): choice is an int64 numpy array of length L with
    the chosen candidate index per layer."""
    sizes, errors, budget, steps = _validated(sizes, errors, budget, steps)
    units = _units(errors, budget, steps)
    units[~np.isfinite(sizes)] = steps + 1
    least_units = units.min(axis=1)
    if least_units.sum() > steps:
        available = np.isfinite(sizes) & np.isfinite(errors)
        least_error = math.fsum(np.where(available, errors, np.inf).min(axis=1))
        raise ValueError(
            f"budget: no assignment of candidates meets the error budget {budget} "
            f"in {steps} steps; the least achievable error is {least_error}"
        )
    # After layer l only totals that the remaining layers can still complete within steps matter.
    room = steps - (least_units.sum() - np.cumsum(least_units))
    caps = steps - (least_units.sum() - least_units)
    fronts = [_pareto_front(*layer) for layer in zip(units, sizes, caps)]
    # Keep each layer's padded input row rather than back-pointers: the choice is re-derived at
    # the one cell the reconstruction visits, which is cheaper than an argmin over every cell.
    inputs, lows = [], []
    low, high, row = 0, 0, np.zeros(1)  # row[j - low] for totals low..high; row[-1] holds above
    for layer, (unit, size, _) in enumerate(fronts):
        shift_min, shift_max = unit.min(), unit.max()
        low, new_high = low + shift_min, min(high + shift_max, room[layer])
        width = new_high - low + 1
        # Below low nothing is reachable; above high the row is flat, since every choice fits.
        padded = np.concatenate(
            [np.full(shift_max - shift_min, np.inf), row, np.full(new_high - shift_min - high, row[-1])]
        )
        row, candidate = np.full(width, np.inf), np.empty(width)
        for offset, cost in zip(shift_max - unit, size):
            np.add(padded[offset : offset + width], cost, out=candidate)
            np.minimum(row, candidate, out=row)
        inputs.append(padded)
        lows.append(low)
        high = new_high
    total = lows[-1] + int(row.argmin())  # first minimum: least rounded error among least sizes
    target = row.min()
    choice = np.empty(len(fronts), dtype=np.int64)
    # Walking back never lands above a row's high: that would reach the least size with fewer units.
    for layer in range(len(fronts) - 1, -1, -1):
        unit, size, index = fronts[layer]
        before = inputs[layer][unit.max() - unit + (total - lows[layer])]
        pick = int(np.argmax(before + size == target))  # lowest index reaching the cell's value
        choice[layer], total, target = index[pick], total - unit[pick], before[pick]
    picked = (np.arange(len(fronts)), choice)
    return choice, math.fsum(sizes[picked]), math.fsum(errors[picked])


def _validated(sizes, errors, budget, steps):
    sizes, errors = np.asarray(sizes, dtype=np.float64), np.asarray(errors, dtype=np.float64)
    if sizes.ndim != 2 or 0 in sizes.shape:
        raise ValueError(f"sizes: must be 2-D (layers, candidates) with both >= 1, got shape {sizes.shape}")
    if errors.shape != sizes.shape:
        raise ValueError(f"errors: shape {errors.shape} differs from sizes' shape {sizes.shape}")
    for name, table in (("sizes", sizes), ("errors", errors)):
        for problem, bad in (("must not be NaN", np.isnan(table)), ("must be >= 0", table < 0)):
            if bad.any():
                layer, candidate = np.argwhere(bad)[0]
                raise ValueError(
                    f"{name}: {problem}, got {table[layer, candidate]} at layer {layer}, candidate {candidate}"
                )
    unavailable = ~(np.isfinite(sizes) & np.isfinite(errors)).any(axis=1)
    if unavailable.any():
        raise ValueError(
            f"sizes, errors: layer {np.argmax(unavailable)} has no candidate with both size and error finite"
        )
    real = isinstance(budget, numbers.Real) and not isinstance(budget, bool)
    if not real or not 0 <= budget < math.inf:
        raise ValueError(f"budget: must be a finite number >= 0, got {budget!r}")
    if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps: must be a positive int, got {steps!r}")
    return sizes, errors, float(budget), int(steps)


def _units(errors, budget, steps):
    """Errors in units of budget / steps rounded up exactly; steps + 1 (never fits) when too big."""
    if budget == 0:
        return np.where(errors == 0, 0, steps + 1)
    with np.errstate(over="ignore"):
        scaled = np.minimum(errors / budget * steps, steps + 1)
    units = np.ceil(scaled).astype(np.int64)
    # Division rounds: near an integer the float may fall on the wrong side, so decide exactly.
    near = (np.abs(scaled - np.rint(scaled)) <= 1e-9 * np.maximum(scaled, 1)) & (errors > 0)
    for layer, candidate in np.argwhere(near & (scaled <= steps)):
        whole = int(np.rint(scaled[layer, candidate]))
        fits = Fraction(errors[layer, candidate]) * steps <= Fraction(budget) * whole
        units[layer, candidate] = whole if fits else whole + 1
    return units


def _pareto_front(units, sizes, cap):
    """(units, sizes, indices) of the candidates within cap that no other matches or beats in
    both units and size, in index order so that ties go to the lowest index."""
    order = np.lexsort((np.arange(len(units)), sizes, units))
    order = order[units[order] <= cap]
    sizes_sorted = sizes[order]
    # Sorted by units, a candidate is worth keeping only if it is smaller than every one before.
    smaller = sizes_sorted < np.minimum.accumulate(np.concatenate([[np.inf], sizes_sorted[:-1]]))
    kept = np.sort(order[smaller])
    return units[kept], sizes[kept], kept
