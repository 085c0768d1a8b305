"""The L-GreCo DP solver against brute force, MILP and its documented guarantee and tie-break."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from hvd_compress.control.solver import solve


def random_instance(rng, layers, candidates, integer):
    """Small tables with ties (integer values) or without, and some unavailable (inf) entries."""
    if integer:
        sizes = rng.integers(0, 6, (layers, candidates)).astype(float)
        errors = rng.integers(0, 5, (layers, candidates)).astype(float)
    else:
        sizes = rng.uniform(0, 10, (layers, candidates))
        errors = rng.uniform(0, 3, (layers, candidates))
    for table in (sizes, errors):
        table[rng.random((layers, candidates)) < 0.15] = np.inf
    sizes[:, 0], errors[:, 0] = 9.0, 3.0  # every layer keeps one available candidate
    return sizes, errors


def assignments(sizes, errors):
    """(choice, exact total size, exact total error) of every assignment of available candidates."""
    layers, candidates = sizes.shape
    for choice in itertools.product(range(candidates), repeat=layers):
        picked = (np.arange(layers), np.array(choice))
        if np.isfinite(sizes[picked]).all() and np.isfinite(errors[picked]).all():
            yield choice, math.fsum(sizes[picked]), math.fsum(errors[picked])


def rounded_units(error, budget, steps):
    return 0 if error == 0 else math.ceil(Fraction(error) * steps / Fraction(budget))


def check_result(sizes, errors, budget, choice, total_size, total_error):
    picked = (np.arange(len(sizes)), choice)
    assert choice.dtype == np.int64 and choice.shape == (len(sizes),)
    assert total_size == math.fsum(sizes[picked]) and total_error == math.fsum(errors[picked])
    assert sum(map(Fraction, errors[picked])) <= Fraction(budget)  # exact, not float, sums


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_within_the_discretisation_guarantee(seed):
    rng = np.random.default_rng(seed)
    layers, candidates = rng.integers(1, 6), rng.integers(1, 6)
    sizes, errors = random_instance(rng, layers, candidates, integer=seed % 2 == 0)
    everything = list(assignments(sizes, errors))
    least, most = min(e for _, _, e in everything), max(e for _, _, e in everything)
    budget = float(rng.uniform(least, most + 1))
    steps = int(rng.choice([1, 3, 7, 10, 100, 10000]))
    tightened = budget - layers * budget / steps
    best_tightened = min((s for _, s, e in everything if e <= tightened), default=None)
    try:
        choice, total_size, total_error = solve(sizes, errors, budget, steps)
    except ValueError as error:
        assert str(error).startswith("budget: no assignment") and best_tightened is None
        return
    check_result(sizes, errors, budget, choice, total_size, total_error)
    assert total_size >= min(s for _, s, e in everything if e <= budget)
    if best_tightened is not None:
        assert total_size <= best_tightened


@pytest.mark.parametrize("seed", range(20))
def test_is_exact_for_rounded_errors_with_the_documented_tie_break(seed):
    """Integer sizes make float sums exact, so the winner is fully specified: least size, then
    least rounded total error, then the lowest candidate index from the last layer back."""
    rng = np.random.default_rng(100 + seed)
    sizes, errors = random_instance(rng, rng.integers(1, 5), rng.integers(2, 5), integer=True)
    budget, steps = float(rng.integers(3, 12)), int(rng.choice([2, 5, 9]))
    keys = []
    for choice, size, _ in assignments(sizes, errors):
        units = sum(rounded_units(errors[layer, c], budget, steps) for layer, c in enumerate(choice))
        if units <= steps:
            keys.append((size, units, choice[::-1]))
    if not keys:
        with pytest.raises(ValueError, match="^budget: no assignment"):
            solve(sizes, errors, budget, steps)
        return
    expected_size, _, expected_reversed = min(keys)
    choice, total_size, _ = solve(sizes, errors, budget, steps)
    assert total_size == expected_size and tuple(choice[::-1]) == expected_reversed


@pytest.mark.parametrize("seed", range(3))
def test_is_no_worse_than_milp_at_the_tightened_budget(seed):
    scipy_optimize = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(200 + seed)
    layers, candidates, steps = 40, 12, 1000
    sizes = rng.uniform(1, 100, (layers, candidates))
    errors = rng.uniform(0, 10, (layers, candidates))
    sizes[rng.random((layers, candidates)) < 0.1] = np.inf
    sizes[:, 0] = 50.0
    budget = float(errors[:, 0].sum())
    tightened = budget - layers * budget / steps
    available = np.isfinite(sizes).ravel()
    one_hot = np.kron(np.eye(layers), np.ones(candidates))
    result = scipy_optimize.milp(
        c=np.where(available, sizes.ravel(), 0.0),
        integrality=1,
        bounds=scipy_optimize.Bounds(0, available.astype(float)),
        constraints=[
            scipy_optimize.LinearConstraint(one_hot, 1, 1),
            scipy_optimize.LinearConstraint(errors.ravel()[None, :], -np.inf, tightened),
        ],
    )
    assert result.success
    choice, total_size, total_error = solve(sizes, errors, budget, steps)
    check_result(sizes, errors, budget, choice, total_size, total_error)
    assert total_size <= result.fun * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_beats_the_uniform_default_it_is_budgeted_by(seed):
    """L-GreCo's use: budget = the error of a uniform default setting d (like ranks: errors fall
    and sizes grow with the index). With many candidates the rounding loss (L * delta) is
    small enough that the solver always finds something at most as large as the default."""
    rng = np.random.default_rng(300 + seed)
    layers, candidates, default = 50, 16, 5
    ranks = np.arange(1, candidates + 1)
    sizes = np.outer(rng.integers(64, 4096, layers), ranks).astype(float)
    decay = rng.uniform(0.5, 2.0, (layers, 1))
    errors = rng.lognormal(0, 1, (layers, 1)) * ranks**-decay
    choice, total_size, total_error = solve(sizes, errors, errors[:, default].sum())
    assert total_size <= sizes[:, default].sum()


@pytest.mark.parametrize(
    "sizes, errors, budget, steps, message",
    [
        ([1.0, 2.0], [1.0, 2.0], 1.0, 10, "sizes: must be 2-D"),
        (np.ones((0, 3)), np.ones((0, 3)), 1.0, 10, "sizes: must be 2-D"),
        (np.ones((2, 3)), np.ones((3, 2)), 1.0, 10, "errors: shape"),
        ([[1.0, np.nan]], [[1.0, 1.0]], 1.0, 10, "sizes: must not be NaN, got nan at layer 0, cand"),
        ([[1.0, 1.0]], [[np.nan, 1.0]], 1.0, 10, "errors: must not be NaN"),
        ([[1.0, -2.0]], [[1.0, 1.0]], 1.0, 10, "sizes: must be >= 0, got -2.0 at layer 0, candidate 1"),
        (np.ones((4, 3)), -np.eye(4, 3)[::-1], 1.0, 10, "errors: must be >= 0, got -1.0 at layer 1, candidate 2"),
        ([[1.0, np.inf], [1.0, 1.0]], [[np.inf, 1.0], [1.0, 1.0]], 1.0, 10, "sizes, errors: layer 0 has no candidate"),
        ([[1.0]], [[1.0]], -1.0, 10, "budget: must be a finite number >= 0"),
        ([[1.0]], [[1.0]], np.inf, 10, "budget: must be a finite number >= 0"),
        ([[1.0]], [[1.0]], np.nan, 10, "budget: must be a finite number >= 0"),
        ([[1.0]], [[1.0]], "1", 10, "budget: must be a finite number >= 0"),
        ([[1.0]], [[1.0]], 1.0, 0, "steps: must be a positive int"),
        ([[1.0]], [[1.0]], 1.0, 2.5, "steps: must be a positive int"),
        ([[1.0]], [[1.0]], 1.0, True, "steps: must be a positive int"),
    ],
)
def test_rejects_bad_arguments_naming_them(sizes, errors, budget, steps, message):
    with pytest.raises(ValueError) as raised:
        solve(sizes, errors, budget, steps)
    assert str(raised.value).startswith(message)


def test_infeasible_budget_reports_the_least_achievable_error():
    errors = [[3.0, 2.0], [1.5, np.inf]]
    message = r"^budget: no assignment .* the least achievable error is 3\.5$"
    with pytest.raises(ValueError, match=message):
        solve([[1.0, 5.0], [1.0, 1.0]], errors, 3.0)


def test_zero_budget_takes_only_error_free_candidates():
    sizes, errors = [[1.0, 8.0, 9.0], [4.0, 2.0, 3.0]], [[0.5, 0.0, 0.0], [0.0, 1.0, 0.0]]
    choice, total_size, total_error = solve(sizes, errors, 0.0)
    assert choice.tolist() == [1, 2] and total_size == 11.0 and total_error == 0.0
    with pytest.raises(ValueError, match="^budget: no assignment"):
        solve([[1.0]], [[0.1]], 0)


def test_errors_on_the_grid_fit_exactly_and_just_off_it_round_up():
    sizes = [[1.0, 2.0]] * 3
    assert solve(sizes, [[0.25, 0.0]] * 3, 0.75, steps=3)[0].tolist() == [0, 0, 0]
    # 0.1 / 0.3 * 3 is 1.0 in floats, but the float 0.1 is more than a third of the float 0.3.
    choice, _, total_error = solve(sizes, [[0.1, 0.0]] * 3, 0.3, steps=3)
    assert choice.tolist() == [1, 1, 0] and total_error <= 0.3


def test_is_deterministic_and_leaves_its_inputs_alone():
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 4, (30, 8)).astype(float)  # many ties
    errors = rng.integers(0, 4, (30, 8)).astype(float)
    sizes_copy, errors_copy = sizes.copy(), errors.copy()
    first = solve(sizes, errors, 40.0, steps=97)
    second = solve(sizes.tolist(), errors.tolist(), 40, steps=np.int64(97))
    assert np.array_equal(first[0], second[0]) and first[1:] == second[1:]
    assert np.array_equal(sizes, sizes_copy) and np.array_equal(errors, errors_copy)
