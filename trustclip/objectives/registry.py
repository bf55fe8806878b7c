"""Objectives as plain functions in a registry, selected by name (verl `core_algos.py` style).

An objective function takes a validated `PolicyBatch` and its hyper-parameters and returns a `TokenLoss`
(aggregation happens elsewhere). Hyper-parameters are declared with `Param` so that a bad value fails at
`get_objective` time with a message naming it and the valid range.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from trustclip.objectives.batch import PolicyBatch
from trustclip.objectives.bounds import check_probability


@dataclass
class TokenLoss:
    """Per-token output of an objective. `loss` is -J_t, (B, T); masks are bool (B, T)."""

    loss: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # (B, T) -> masked mean, () -> as is

    @classmethod
    def outside(cls, loss: torch.Tensor, adv: torch.Tensor, below: torch.Tensor, above: torch.Tensor,
                **stats: torch.Tensor) -> TokenLoss:
        """Clipped tokens: those outside the region on the side A favours (below it with A < 0, above it with A > 0)."""
        return cls(loss, clipped_low=below & (adv < 0), clipped_high=above & (adv > 0), stats=stats)

    @classmethod
    def unclipped(cls, loss: torch.Tensor, **stats: torch.Tensor) -> TokenLoss:
        """An objective that holds no token: both masks all False."""
        none = torch.zeros_like(loss, dtype=torch.bool)
        return cls(loss, clipped_low=none, clipped_high=none, stats=stats)


@dataclass(frozen=True)
class Param:
    """A hyper-parameter: default, validity test, and the rule shown when the test fails."""

    default: Any
    check: Callable[[Any], bool]
    rule: str
    doc: str = ""


def is_finite_number(x: Any) -> bool:
    """A real number (not a bool), neither NaN nor infinite."""
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def number(default: float, low: float | None = None, high: float | None = None, *, strict_low=False,
           optional=False, doc: str = "") -> Param:
    """A finite number in [low, high] (or (low, high] with strict_low); None allowed if optional."""

    def check(x: Any) -> bool:
        if x is None:
            return optional
        return (is_finite_number(x) and (low is None or (x > low if strict_low else x >= low))
                and (high is None or x <= high))

    lo = "" if low is None else (f"> {low}" if strict_low else f">= {low}")
    hi = "" if high is None else f"<= {high}"
    rule = " and ".join(r for r in (lo, hi) if r) or "a finite number"
    if optional:
        rule += " (or None)"
    return Param(default, check, rule, doc)


def choice(default: Any, *options: Any, doc: str = "") -> Param:
    allowed = (default, *options)
    return Param(default, lambda x: x in allowed, f"one of {allowed}", doc)


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    fn: Callable[..., TokenLoss]
    params: Mapping[str, Param]
    source: str
    summary: str
    requires: Callable[[Mapping[str, Any]], tuple[str, ...]] = lambda hp: ()
    bounds: Callable[..., tuple] | None = None  # (hparams) -> (l, u), or (hparams, q) if q_dependent
    q_dependent: bool = False
    aliases: tuple[str, ...] = ()
    check_all: Callable[[Mapping[str, Any]], None] | None = None  # cross-parameter validation
    constraint: Callable[[Mapping[str, Any]], Any] | None = None  # (hparams) -> Constraint, of clipping objectives


REGISTRY: dict[str, ObjectiveSpec] = {}
ALIASES: dict[str, str] = {}


def register_objective(name: str, *, source: str, summary: str, params: Mapping[str, Param] | None = None,
                       constraint: Callable[[Mapping[str, Any]], Any] | None = None, **options: Any) -> Callable:
    """Decorator: register `fn(batch, **hparams) -> TokenLoss` under `name` (and its aliases).

    An objective of the clipping framework states its constraint once, `constraint(hparams) -> Constraint`: its
    function then receives that constraint, `fn(batch, constraint)`, and its ratio region is the constraint's
    `bounds` unless `bounds` is given."""

    def wrap(fn: Callable[..., TokenLoss]) -> Callable[..., TokenLoss]:
        if name in REGISTRY or name in ALIASES:
            raise ValueError(f"objective {name!r} is already registered")
        if constraint is not None:
            options.setdefault("bounds", lambda hp: constraint(hp).bounds)
            options["constraint"] = constraint
        spec = ObjectiveSpec(name, fn, MappingProxyType(dict(params or {})), source, summary, **options)
        REGISTRY[name] = spec
        ALIASES.update(dict.fromkeys(spec.aliases, name))
        return fn

    return wrap


@dataclass(frozen=True)
class Objective:
    """A registered objective bound to validated hyper-parameters; call it on a PolicyBatch."""

    spec: ObjectiveSpec
    hparams: Mapping[str, Any]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def requires(self) -> tuple[str, ...]:
        """Extra (B, T) inputs this configuration needs, e.g. ('entropy',) or ('full_kl',)."""
        return self.spec.requires(self.hparams)

    @property
    def constraint(self) -> Any:
        """The Constraint of a clipping objective at these hyper-parameters (None: it states none)."""
        return None if self.spec.constraint is None else self.spec.constraint(self.hparams)

    def __call__(self, batch: PolicyBatch) -> TokenLoss:
        if self.spec.constraint is not None:
            return self.spec.fn(batch, self.constraint)
        return self.spec.fn(batch, **self.hparams)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hparams.items())
        return f"Objective({self.name}: {args})"


def resolve_name(name: str) -> ObjectiveSpec:
    key = ALIASES.get(name, name)
    if not isinstance(name, str) or key not in REGISTRY:
        valid = sorted([*REGISTRY, *ALIASES])
        raise ValueError(f"unknown objective {name!r}; valid names: {', '.join(valid)}")
    return REGISTRY[key]


def get_objective(name: str | Objective, **hparams: Any) -> Objective:
    """Look up an objective by name (or alias) and bind hyper-parameters over its defaults.

    Raises ValueError naming an unknown objective or hyper-parameter, or a bad value and its rule.
    """
    if isinstance(name, Objective):
        return name if not hparams else get_objective(name.name, **{**name.hparams, **hparams})
    spec = resolve_name(name)
    unknown = set(hparams) - set(spec.params)
    if unknown:
        valid = ", ".join(spec.params) or "none"
        raise ValueError(f"unknown hyper-parameter(s) {sorted(unknown)} for objective {spec.name!r}; valid: {valid}")
    values = {k: p.default for k, p in spec.params.items()} | hparams
    for key, value in values.items():
        param = spec.params[key]
        if not param.check(value):
            raise ValueError(f"{spec.name}: {key}={value!r} is invalid; it must be {param.rule}")
    if spec.check_all is not None:
        spec.check_all(values)
    return Objective(spec, MappingProxyType(values))


def ratio_bounds(name: str | Objective, q: Any = None, **hparams: Any):
    """Ratio region (low, high) of an objective's constraint.

    For probability-dependent regions (dcpo, trgppo) pass `q` (old token probability in (0, 1]: float, array or
    tensor) to get the bounds there; without q you get a pair of functions of q.
    """
    objective = get_objective(name, **hparams)
    spec = objective.spec
    if spec.bounds is None:
        raise ValueError(f"objective {spec.name!r} has no ratio interval: {spec.summary}")
    if not spec.q_dependent:
        if q is not None:
            raise ValueError(f"objective {spec.name!r} has constant bounds; q does not apply")
        return spec.bounds(objective.hparams)
    if q is None:
        return (lambda x: spec.bounds(objective.hparams, x)[0], lambda x: spec.bounds(objective.hparams, x)[1])
    return spec.bounds(objective.hparams, check_probability(q))


def list_objectives() -> list[dict[str, Any]]:
    """Every registered objective: name, aliases, source, summary, defaults, extra inputs needed."""
    rows = []
    for spec in REGISTRY.values():
        defaults = {k: p.default for k, p in spec.params.items()}
        rows.append({
            "name": spec.name,
            "aliases": list(spec.aliases),
            "source": spec.source,
            "summary": spec.summary,
            "defaults": {k: v for k, v in defaults.items() if k != "constraint"},
            "requires": list(spec.requires(defaults)),
        })
    return rows
