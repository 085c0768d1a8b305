"""L-GreCo's decision (Markov et al., MLSys 2024, Algorithm 1), computed on rank 0 in a
background thread from snapshots of the controller's state: what it returns (``Decision``), how
it is made (``decide``) and logged (``format_decision``), and the time objective's model."""

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hvd_compress.control.solver import solve

# Keys of the window's mean norms among the accumulated sums ("<name>\0gradient_norm"): kept
# with the sums, they stage, roll back, clear and checkpoint with them.
NORM_KEY = "\0"


@dataclass
class Decision:
    version: int
    decided_at: int  # the step whose accumulated gradients were analysed
    effective_step: int  # the first step that runs with these settings
    settings: dict  # parameter name -> setting of the wrapped compressor
    total_bytes: int
    uniform_bytes: int
    total_error: float
    budget: float
    objective: str
    seconds: float = 0.0
    step_seconds: float = 0.0  # rank 0's running step time when the decision was submitted
    notes: list = field(default_factory=list)
    # What the solver saw, per layer it decided: "options", "bytes" and "errors" (its rows of
    # the tables), "chosen" and "default" (indices into them), and the window's mean per-step
    # "gradient_norm" and "residual_norm" (unscaled; the residual before each step's compression).
    layers: dict = field(default_factory=dict)


def decide(inner, config, previous_norms, sums, norms, shapes, samples, pending, step_seconds):
    """The decision of L-GreCo's Algorithm 1 on rank 0, off the training thread: the error and
    size tables of every layer ``inner`` (the wrapped compressor) compresses at its default,
    at each candidate setting; the least total size (or time, under ``config.objective``) whose
    total error is at most the defaults' (``solver.solve``). ``sums``: {name: the window's mean
    gradient (plus residual)}; ``norms``: the window's mean norms (``NORM_KEY`` keys);
    ``shapes``: {name: shape}, in the order gradients arrive; ``samples``: the time objective's
    (bytes per bucket, seconds); ``pending``: (version, decided_at, effective_step);
    ``previous_norms``: Accordion's norms at the last decision, updated."""
    version, decided_at, effective_step = pending
    tuning = inner.tuning
    start = time.perf_counter()
    notes = []
    defaults = _defaults(inner, config, previous_norms, sums, shapes)
    names = sorted(name for name in sums if config.dense_candidates or tuning.compresses(shapes[name], defaults[name]))
    weights = _time_weights(names, shapes, samples, config.time_buckets, notes) if config.objective == "time" else None
    candidates = {}
    for name in names:
        options = tuning.candidates(shapes[name], defaults[name], config.candidates)
        if not config.dense_candidates:
            options = [o for o in options if tuning.compresses(shapes[name], o)]
        candidates[name] = options
    # All layers at once: the compressor batches layers of one shape (low-rank's svdvals).
    computed = tuning.errors_of_layers({name: (sums[name], candidates[name]) for name in names})
    # One device-to-host transfer for the whole table and the window's norms.
    read = read_rows({**computed, **norms})
    rows = []
    for name in names:
        shape, options = shapes[name], candidates[name]
        errors = [0.0 if not tuning.compresses(shape, o) else e for o, e in zip(options, read[name])]
        sizes = [tuning.payload_bytes(shape, o) for o in options]
        rows.append((options, sizes, errors, options.index(tuning.resolve(shape, defaults[name]))))
    width = max((len(options) for options in candidates.values()), default=0)
    size_table = np.full((len(names), width), np.inf)
    error_table = np.full((len(names), width), np.inf)
    for i, (options, sizes, errors, _) in enumerate(rows):
        size_table[i, : len(options)] = sizes
        error_table[i, : len(options)] = errors
    defaults_at = [row[3] for row in rows]
    budget = float(sum(error_table[i, d] for i, d in enumerate(defaults_at)))
    uniform_bytes = int(sum(size_table[i, d] for i, d in enumerate(defaults_at)))
    cost = size_table if weights is None else size_table * weights[:, None]
    # The uniform default meets the budget exactly; the solver, which rounds errors up to
    # stay feasible, can miss it by up to one step per layer. Keep whichever costs less.
    uniform = np.array(defaults_at)
    choice, total_error = uniform, budget
    try:
        solved, _, solved_error = solve(cost, error_table, budget, config.discretization)
        if cost[np.arange(len(names)), solved].sum() < cost[np.arange(len(names)), uniform].sum():
            choice, total_error = solved, solved_error
    except ValueError as error:
        notes.append(f"kept the defaults: {error}")
    settings = {name: options[c] for name, (options, _, _, _), c in zip(names, rows, choice)}
    total_bytes = int(sum(size_table[i, c] for i, c in enumerate(choice)))
    layers = {}
    for name, (options, sizes, errors, default_at), chosen in zip(names, rows, choice):
        layers[name] = {
            "options": list(options),
            "bytes": [int(b) for b in sizes],
            "errors": [float(e) for e in errors],
            "chosen": int(chosen),
            "default": int(default_at),
        }
        for kind in ("gradient_norm", "residual_norm"):
            layers[name][kind] = read.get(name + NORM_KEY + kind, [0.0])[0]
    return Decision(
        version,
        decided_at,
        effective_step,
        settings,
        total_bytes,
        uniform_bytes,
        float(total_error),
        budget,
        config.objective,
        time.perf_counter() - start,
        step_seconds,
        notes,
        layers,
    )


def _defaults(inner, config, previous_norms, sums, shapes):
    """Each layer's default setting, whose total error is the budget: the wrapped
    compressor's uniform default, or Accordion's choice (densities become k for TopK)."""
    if config.objective != "accordion":
        return {name: inner.config.default for name in sums}
    defaults = {}
    for name, gradient in sums.items():
        norm = gradient.norm().item()
        before = previous_norms.get(name)
        critical = before is None or abs(norm - before) >= config.accordion.threshold * before
        value = config.accordion.critical if critical else config.accordion.normal
        defaults[name] = inner.tuning.setting_for_value(shapes[name], value)
        previous_norms[name] = norm
    return defaults


def _time_weights(names, shapes, samples, buckets, notes):
    coefficients = fit_bucket_seconds_per_byte(samples, buckets)
    if coefficients is None:
        notes.append(f"time model not identifiable from {len(samples)} samples; optimised size instead")
        return None
    return np.array([coefficients[bucket_of(name, shapes, buckets)] for name in names])


def bucket_of(name, shapes, buckets):
    """Layers split into ``buckets`` consecutive groups in the order gradients arrive (``shapes``'
    order): the time objective's bucket of ``name``."""
    order = list(shapes)
    return min(buckets - 1, order.index(name) * buckets // len(order))


def read_rows(rows):
    """{key: 1-D tensor} as {key: list of floats}, in one device-to-host transfer."""
    if not rows:
        return {}
    device = next(iter(rows.values())).device
    flat = torch.cat([row.reshape(-1).to(device, torch.float64) for row in rows.values()]).tolist()
    read, start = {}, 0
    for key, row in rows.items():
        read[key], start = flat[start : start + row.numel()], start + row.numel()
    return read


def fit_bucket_seconds_per_byte(samples, buckets):
    """Least squares fit of seconds = a + sum_b t_b * bytes_b over measured steps: the paper's
    per-bucket time coefficients. None while the samples cannot identify every t_b > 0."""
    if len(samples) < buckets + 2:
        return None
    x = np.array([[1.0] + list(b) for b, _ in samples])
    y = np.array([s for _, s in samples])
    if np.linalg.matrix_rank(x) < buckets + 1:
        return None
    coefficients = np.linalg.lstsq(x, y, rcond=None)[0][1:]
    if not np.all(coefficients > 0):
        return None
    return coefficients


def format_decision(decision, inner):
    label = inner.setting_name
    lines = [
        f"L-GreCo decision {decision.version} ({decision.objective}; gradients up to step "
        f"{decision.decided_at}, effective from step {decision.effective_step}, computed in "
        f"{decision.seconds:.2f} s): {decision.total_bytes} bytes/step vs "
        f"{decision.uniform_bytes} uniform ({decision.uniform_bytes / max(decision.total_bytes, 1):.2f}x "
        f"fewer); error {decision.total_error:.4g} of budget {decision.budget:.4g}"
    ]
    lines += [f"  {note}" for note in decision.notes]
    lines += [f"  {name}: {label} {value}" for name, value in sorted(decision.settings.items())]
    return "\n".join(lines)
