"""Argument checks for constructors: a bad argument raises ``ValueError`` naming the class, the
parameter and what was wrong, at construction rather than steps later.

A leaf module: it imports nothing from the package, and every layer may use it."""

import math
from numbers import Integral, Real
from typing import Any, Dict, Optional

import torch


def integer(owner: str, label: str, value: Any, *, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """``value`` if it is an int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{owner}: {label} must be an integer, got {value!r}")
    _in_range(owner, label, value, low, high, low_open=False)
    return int(value)


def real(
    owner: str,
    label: str,
    value: Any,
    *,
    low: Optional[float] = None,
    high: Optional[float] = None,
    low_open: bool = False,
) -> float:
    """``value`` as a float if it is a finite real number (not a bool) in [low, high], or
    (low, high] with ``low_open``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{owner}: {label} must be a finite number, got {value!r}")
    _in_range(owner, label, value, low, high, low_open)
    return float(value)


def flag(owner: str, label: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {label} must be True or False, got {value!r}")
    return value


def choice(owner: str, label: str, value: Any, options) -> Any:
    if value not in options:
        raise ValueError(f"{owner}: {label} must be one of {tuple(options)}, got {value!r}")
    return value


def named_parameters(owner: str, pairs: Any) -> Dict[str, torch.Tensor]:
    """{name: parameter} from ``model.named_parameters()``-like pairs, refusing anything else
    (bare parameters, duplicate names)."""
    pairs = list(pairs)
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and torch.is_tensor(item[1])):
            raise ValueError(
                f"{owner}: named_parameters must be (name, parameter) pairs, as "
                f"model.named_parameters() gives; got an item of type "
                f"{type(item).__name__}"
            )
    names = [name for name, _ in pairs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"{owner}: named_parameters has duplicate names {duplicates}")
    return dict(pairs)


def _in_range(owner, label, value, low, high, low_open):
    below = low is not None and (value <= low if low_open else value < low)
    if below or (high is not None and value > high):
        interval = f"{'(' if low_open else '['}{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise ValueError(f"{owner}: {label} must lie in {interval}, got {value!r}")
