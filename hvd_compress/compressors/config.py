"""One configuration object per method, and the one checkpoint header, for compressors and
controllers alike.

A method's configuration is a frozen dataclass (``MethodConfig`` and its subclasses, one per
compressor family and controller) that

* is checked when it is made: a bad value raises ``ValueError`` naming the method, the
  parameter and what was wrong (``owner`` names the method in the message). A field declares
  its check beside its default, ``seed: int = option(0, arguments.integer)`` or
  ``density: float = option(0.01, arguments.real, low=0, high=1, low_open=True)``, and keeps
  the value the check returns (``arguments.real`` makes an int a float); a subclass that only
  changes a default (``min_numel: int = 0``) keeps the check its base declared. A class
  overrides ``check`` only for what spans fields or needs its own label (a bound set by
  another field, a value that may also be None or a word);
* ``describe()``s itself for the cross-rank check (``GradientCompression.describe``) and for
  checkpoints, as checkpoints hold it: tuples as lists, nested dataclasses as dicts. Fields
  declared ``option(..., agreed=False)`` are this process's own business (L-GreCo's transport
  and timeout) and left out;
* is recorded in every checkpoint by ``checkpoint_header`` and compared against it by
  ``check_checkpoint``, which refuses a checkpoint of another class or configuration.

It is the one declaration of a method's options and defaults: a constructor takes either the
configuration itself (``config=``) or its fields as keywords, and builds it with ``configured``.
"""

import dataclasses
import functools
from dataclasses import MISSING, InitVar, dataclass, field, fields
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Type, TypeVar

from hvd_compress import arguments

Config = TypeVar("Config", bound="MethodConfig")


def option(
    default: Any = MISSING, check: Optional[Callable[..., Any]] = None, *, agreed: bool = True, **limits: Any
) -> Any:
    """A configuration field with its ``default`` (none: a required field) and its ``check``,
    called as ``check(owner, name, value, **limits)`` (``arguments.integer``, ``real``, ``flag``,
    ``choice``) and returning the value to keep. ``agreed=False``: the field need not agree
    across ranks nor with a checkpoint."""
    if limits and check is None:
        raise TypeError(f"option: limits {sorted(limits)} without a check to apply them")
    return field(
        default=default,
        metadata={"check": None if check is None else functools.partial(check, **limits), "agreed": agreed},
    )


@dataclass(frozen=True, kw_only=True)
class MethodConfig:
    """Base of every method's configuration; subclasses add fields, each declared with its
    check (``option``), and override ``check`` only for what spans fields."""

    owner: InitVar[str] = ""

    def __post_init__(self, owner: str) -> None:
        owner = owner or type(self).__name__.removesuffix("Config")
        for each in fields(self):
            check = _declared(type(self), each.name).get("check")
            if check is not None:
                self._keep(each.name, check(owner, each.name, getattr(self, each.name)))
        self.check(owner)

    def check(self, owner: str) -> None:
        """Raises ``ValueError`` naming ``owner`` and the parameter for a bad value, after every
        field's own check; for what spans fields or needs its own label."""

    def _keep(self, name: str, value: Any) -> None:
        """Stores a normalised value in the frozen configuration."""
        object.__setattr__(self, name, value)

    def describe(self) -> Dict[str, Any]:
        """The fields that must agree on every rank and with a checkpoint, as plain data."""
        return {
            f.name: _plain(getattr(self, f.name))
            for f in fields(self)
            if _declared(type(self), f.name).get("agreed", True)
        }


def _declared(kind: type, name: str) -> Mapping[str, Any]:
    """What ``option`` declared for field ``name``: in ``kind`` or, where a subclass only
    changed the default, in the nearest base that declared it."""
    for klass in kind.__mro__:
        declared = vars(klass).get("__dataclass_fields__", {}).get(name)
        if declared is not None and declared.metadata:
            return declared.metadata
    return {}


@dataclass(frozen=True, kw_only=True)
class CompressorConfig(MethodConfig):
    """What every compressor has: ``min_numel`` (smaller gradients, and every 1-D gradient, are
    all-reduced uncompressed), ``default``, the per-parameter setting unless overridden
    (checked by the compressor itself, which alone knows its settings), and ``compiled``: run
    the codec's arithmetic between collectives through ``torch.compile`` where the compressor
    has compiled kernels (``maths.compiled``; QSGD's encode and decode, Top-K's selection
    flags), compiled before the first collective, eagerly on every rank where some rank cannot
    compile. Agreed across ranks and recorded in checkpoints: compiled and eager kernels may
    round differently."""

    min_numel: int = option(1024, arguments.integer, low=0)
    default: Any = None
    compiled: bool = option(False, arguments.flag)


def configured(
    kind: Type[Config], owner: str, config: Optional[Config], options: Dict[str, Any], **named: Any
) -> Config:
    """The configuration a constructor of ``owner`` runs with: ``config`` as given, or a ``kind``
    built from ``options`` (its fields as keywords) and ``named`` (the fields the constructor
    names itself, such as the positional rank, whose default in its signature is the field's).
    Raises ``TypeError`` for a keyword that is not an option, ``ValueError`` for a config of
    another kind or a config together with options."""
    if config is not None:
        # A named field left at its default was not given.
        given = [key for key, value in named.items() if value != getattr(kind, key)] + sorted(options)
        if given:
            raise ValueError(
                f"{owner}: pass either config or its options as arguments, not both (got config and {given})"
            )
        if not isinstance(config, kind):
            raise ValueError(f"{owner}: config must be a {kind.__name__}, got {type(config).__name__}")
        return config
    # The fields the constructor names itself (``default``, as "rank") are not keywords.
    accepted = [f.name for f in fields(kind) if f.name not in named and f.name != "default"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(
            f"{owner}: unexpected keyword argument {unknown[0]!r}; the options are "
            f"{', '.join(accepted)} (or config={kind.__name__}(...))"
        )
    return kind(owner=owner, **options, **named)


def _plain(value):
    """As checkpoints hold it (what ``torch.load`` returns): tuples become lists, dataclasses dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def checkpoint_header(owner: str, config: MethodConfig) -> Dict[str, Any]:
    """What a checkpoint of ``owner`` (a class name) starts with: its class and configuration."""
    return {"class": owner, "config": config.describe()}


def check_checkpoint(owner: str, state_dict: Dict[str, Any], keys: Iterable[str], config: MethodConfig) -> None:
    """Raises ``ValueError`` unless ``state_dict`` has ``keys`` (besides the header) and is a
    checkpoint of ``owner`` taken with ``config``, naming the first difference."""
    missing = ({"class", "config"} | set(keys)) - set(state_dict)
    if missing:
        raise ValueError(f"{owner}.load_state_dict: not an hvd_compress {owner} checkpoint (missing {sorted(missing)})")
    if state_dict["class"] != owner:
        raise ValueError(
            f"{owner}.load_state_dict: the checkpoint is a {state_dict['class']} checkpoint, not a {owner} one"
        )
    mine, theirs = config.describe(), dict(state_dict["config"])
    # A checkpoint taken before a field existed ran with that field's default.
    for each in fields(config):
        if each.name in mine and each.name not in theirs and each.default is not MISSING:
            theirs[each.name] = _plain(each.default)
    for key in sorted(set(mine) | set(theirs)):
        if mine.get(key) != theirs.get(key):
            raise ValueError(
                f"{owner}.load_state_dict: {key} is {theirs.get(key)!r} in the checkpoint but {mine.get(key)!r} here"
            )


def parameter_error(owner: Any, name: Optional[str], message: str) -> ValueError:
    """The ``ValueError`` to raise about ``owner``'s (a compressor's) parameter ``name`` (None:
    about the compressor as a whole), naming its class."""
    where = f"parameter {name!r}: " if name is not None else ""
    return ValueError(f"{type(owner).__name__}: {where}{message}")
