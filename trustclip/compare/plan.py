"""An experiment as data: groups (each item of `--objectives` at each value of `--sweep`) x seeds, each run a full
training config validated as `trustclip train` validates it, in a folder named by its settings (equal settings written
differently share one run of a pool); each seed's RL runs start from one SFT model, as in the paper."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from trustclip.settings import RUN_CONTROL, TrainConfig, from_dict, get_dotted, name_objective, parse_value, set_dotted

RUNS_DIR = "runs"
SPEC_FILE = "run_spec.json"
EVAL_POINTS = 5  # periodic evaluations per run when the recipe has none (eval accuracy vs step)
# (key, values) of `--sweep`: an objective hyper-parameter (`delta`) or, with a dot, a training option of every run
Sweep = tuple[str, tuple[Any, ...]]


class Entry(NamedTuple):
    """One item of `--objectives`: an objective with a variant's own hyper-parameters."""

    kwargs: dict[str, Any]
    label: str  # the item as written, spaces removed: the group's name
    spec: Any  # the registered objective (trustclip.objectives.registry.ObjectiveSpec)


@dataclass
class RunSpec:
    """One training run of the comparison."""

    label: str  # the item of --objectives as written (e.g. "atr", "clip[epsilon=0.3]")
    objective: str  # registered name (e.g. "kl3")
    seed: int
    hparams: dict[str, Any]  # resolved objective hyper-parameters (defaults filled in)
    config: dict[str, Any]  # full TrainConfig as a dict (output_dir is set by the worker)
    sweep_key: str | None = None
    sweep_value: Any = None
    root: Path = field(default=Path("."), repr=False)
    kind: str = "rl"  # "rl": a compared run; "sft": a shared SFT run other runs start from
    depends_on: RunSpec | None = field(default=None, repr=False)
    folder: str = ""  # directory under runs/, from the settings (an SFT run: its label)

    @property
    def group(self) -> str:
        """Name of the (objective, sweep value) group that seeds are aggregated over; a swept value in short, stable
        text (0.07 -> '0.07', 1e-05 -> '1e-05')."""
        if self.sweep_key is None:
            return self.label
        value = f"{self.sweep_value:g}" if isinstance(self.sweep_value, float) else self.sweep_value
        return f"{self.label}_{self.sweep_key}={value}"

    @property
    def run_id(self) -> str:
        return f"{self.group}/seed{self.seed}"

    @property
    def run_dir(self) -> Path:
        return self.root / RUNS_DIR / (self.folder or self.label) / f"seed{self.seed}"

    def fingerprint(self) -> str:
        """Hash of everything that determines the run's numbers (its SFT run's fingerprint included)."""
        science = {k: v for k, v in self.config.items() if k not in RUN_CONTROL}
        if self.depends_on is not None:
            science["depends_on"] = self.depends_on.fingerprint()
        return hashlib.sha256(json.dumps(science, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """The run_spec.json the worker runs; its SFT model (if any) relative to it, so that a pool can be moved."""
        dep = self.depends_on
        return {"run_id": self.run_id, "group": self.group, "label": self.label, "objective": self.objective,
                "seed": self.seed, "hparams": self.hparams, "sweep_key": self.sweep_key,
                "sweep_value": self.sweep_value, "fingerprint": self.fingerprint(), "kind": self.kind,
                "depends_on": dep.run_id if dep else None,
                "start_model": os.path.relpath(dep.run_dir / "sft" / "final", self.run_dir) if dep else None,
                "config": self.config}


def canonical_text(value: Any) -> str:
    """A value in a directory name: numbers by value (0.1 = 1e-1 -> '0.1', 3 = 3.0 -> '3', full precision)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
        return str(int(number)) if number.is_integer() and abs(number) < 1e15 else repr(number)
    return value if isinstance(value, str) else json.dumps(value)


# ------------------------------------------------------------------------------------------------ parsing
def parse_entry(item: str) -> Entry:
    """'clip_higher[epsilon_low=0.3, epsilon_high=0.4]' -> Entry({...}, 'clip_higher[epsilon_low=0.3,...]', spec)."""
    from trustclip.objectives.registry import resolve_name  # imports torch: not before a name is resolved

    match = re.fullmatch(r"([A-Za-z0-9_-]+)(?:\[(.*)\])?", re.sub(r"\s+", "", item))
    if match is None:
        raise ValueError(f"objective {item!r}: expected NAME or NAME[KEY=VALUE,...], e.g. clip[epsilon=0.3]")
    name, inner = match.groups()
    spec, kwargs = resolve_name(name), {}
    for pair in (inner.split(",") if inner is not None else []):
        key, sep, raw = pair.partition("=")
        if not sep or not key or not raw:
            raise ValueError(f"objective {item!r}: expected KEY=VALUE inside the brackets, got {pair!r}")
        if key in kwargs:
            raise ValueError(f"objective {item!r}: {key} is given twice")
        if key not in spec.params:
            raise ValueError(f"objective {item!r}: {spec.name} has no hyper-parameter {key!r}; "
                             f"valid: {', '.join(spec.params) or 'none'}")
        kwargs[key] = parse_value(raw)
    return Entry(kwargs, match.group(0), spec)


def parse_objectives(text: str | Sequence[str]) -> list[str]:
    """'clip, clip[epsilon=0.3], atr' -> ['clip', 'clip[epsilon=0.3]', 'atr'] (commas inside brackets stay).
    Rejects unknown names and hyper-parameters, an item given twice and one objective listed twice without brackets
    (aliases included); the values are validated with the rest of the run's settings by `plan_runs`."""
    if isinstance(text, str):
        if not re.fullmatch(r"[^\[\]]*(\[[^\[\]]*\][^\[\]]*)*", text):  # brackets in pairs, none in another
            raise ValueError(f"--objectives {text!r}: unbalanced or nested brackets")
        text = re.split(r",(?![^\[]*\])", text)
    seen: dict[str, str] = {}  # an objective (or a variant as written) -> its item
    for entry in (parse_entry(item) for item in text if item.strip()):
        key = entry.label if entry.kwargs else entry.spec.name
        if key in seen:
            same = "the same item" if entry.kwargs else f"the same objective ({key})"
            raise ValueError(f"objectives {seen[key]!r} and {entry.label!r} are {same}; give a variant its own "
                             "hyper-parameters, e.g. clip[epsilon=0.3]")
        seen[key] = entry.label
    if not seen:
        raise ValueError("no objectives given; e.g. --objectives clip,atr")
    return list(seen.values())


def resolve_reference(name: str | None, groups: Sequence[tuple[str, str, str]]) -> str:
    """The reference group among (group, label, objective) triples in plan order: `name` (whitespace ignored) as a
    group name or an item of --objectives as written; by default the first group of objective `clip`, else the
    first."""
    groups = list(dict.fromkeys(groups))
    if name is None:
        return next((g for g, _, objective in groups if objective == "clip"), groups[0][0])
    written = re.sub(r"\s+", "", name)
    candidates = [g for g, label, _ in groups if written in (g, label)]
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        raise ValueError(f"--reference {name!r} names {len(candidates)} groups ({', '.join(candidates)}); "
                         "give one of them")
    raise ValueError(f"--reference {name!r} is not a compared group; groups: {', '.join(g for g, _, _ in groups)}")


def parse_seeds(count: int) -> list[int]:
    """`--seeds N`: seeds 0..N-1."""
    if isinstance(count, bool) or count < 1:
        raise ValueError(f"--seeds must be an integer >= 1, got {count!r}")
    return list(range(count))


_LIST = "list the objectives with --objectives (an objective at other hyper-parameters: NAME[KEY=V])"
NOT_SWEEPABLE = {  # settings --sweep cannot vary, and what varies them (and RUN_CONTROL: no run changes)
    "rl.objective": _LIST, "objective": _LIST, "seed": "give the seeds with --seeds",
    "rl.objective_kwargs": "sweep one hyper-parameter by its name (--sweep delta=0.05,0.1), or list variants "
                           "NAME[KEY=V] in --objectives",
    "stages": "compare runs every stage; set them for all runs with --set stages=...",
    **dict.fromkeys(RUN_CONTROL, "it does not change what a run computes"),
}


def parse_sweep(text: str | None) -> Sweep | None:
    """'delta=0.03,0.05' -> ('delta', (0.03, 0.05))."""
    if not text:
        return None
    key, sep, raw = text.partition("=")
    key, values = key.strip(), tuple(parse_value(v.strip()) for v in raw.split(",") if v.strip())
    if not sep or not key or not values:
        raise ValueError(f"--sweep {text!r}: expected KEY=V1,V2,..., e.g. delta=0.03,0.05,0.07")
    if key.startswith("rl.objective_kwargs."):
        raise ValueError(f"--sweep {text!r}: an objective's hyper-parameter is swept by its name: --sweep "
                         f"{key.rsplit('.', 1)[-1]}=...")
    if key in NOT_SWEEPABLE:
        raise ValueError(f"--sweep {text!r}: {key} is not a sweepable setting; {NOT_SWEEPABLE[key]}")
    if any(v is None or isinstance(v, dict | list) for v in values):
        raise ValueError(f"--sweep {text!r}: values must be numbers, strings or booleans")
    if len(set(map(repr, values))) != len(values):
        raise ValueError(f"--sweep {text!r}: repeated values")
    return key, values


# ----------------------------------------------------------------------------------------------- planning
def base_config(recipe: str | Path | None, overrides: Sequence[str]) -> dict[str, Any]:
    """Recipe (with its `base:` chain) + `--set` overrides, as the trainer resolves them, as a nested dict; where
    rl.eval_every is 0 and --set does not say so, EVAL_POINTS periodic evaluations (the accuracy-vs-step figure)."""
    from trustclip.settings import load_config, parse_override

    keys = [parse_override(text)[0] for text in overrides]
    for text, key in zip(overrides, keys, strict=True):
        if key in ("seed", "output_dir", "resume", "rl.objective", "rl.objective_kwargs"):
            raise ValueError(f"--set {text!r}: {key} is set by compare itself (use --objectives/--seeds)")
    base = load_config(recipe, list(overrides)).to_dict()
    if base["rl"]["eval_every"] == 0 and "rl.eval_every" not in keys:
        base["rl"]["eval_every"] = max(1, base["rl"]["max_steps"] // EVAL_POINTS)
    return base


def _make_run(entry: Entry, seed: int, base: dict[str, Any], sweep_key: str | None, value: Any, root: Path) -> RunSpec:
    """The run of `entry` at `seed` (and `value` of `sweep_key`), its config validated by TrainConfig itself."""
    from trustclip.objectives.registry import get_objective

    option = sweep_key is not None and "." in sweep_key  # a swept training option, else a swept hyper-parameter
    kwargs = dict(entry.kwargs)
    if sweep_key is not None and not option:
        if sweep_key in kwargs:  # one of the two values would be silently unused
            raise ValueError(f"--sweep {sweep_key}: the variant {entry.label!r} sets {sweep_key} itself; sweep it or "
                             "set it, not both")
        kwargs[sweep_key] = value
    rl = copy.deepcopy(base["rl"])
    recipe = name_objective(rl, entry.spec.name, kwargs, keep_own=True)  # the recipe's, for its own objective
    try:
        objective = get_objective(entry.spec.name, **rl["objective_kwargs"])
    except ValueError as err:
        raise ValueError(f"objective {entry.label!r}: {err}") from None
    # The kwargs the config records are the same however they were written, so that equal settings have one
    # fingerprint: a value equal to the objective's default is left out (unless it overrides the recipe's), an
    # integer given for a float parameter is that float.
    params = objective.spec.params
    canonical = {key: float(v) if isinstance(params[key].default, float) and type(v) is int else v
                 for key, v in rl["objective_kwargs"].items()}
    data = copy.deepcopy(base)
    if option:
        set_dotted(data, sweep_key, value)
    data["seed"] = seed
    data["rl"] |= {"objective": objective.name,
                   "objective_kwargs": {k: v for k, v in canonical.items() if k in recipe or v != params[k].default}}
    try:
        config = from_dict(TrainConfig, data).to_dict()
    except ValueError as err:
        raise ValueError(f"run {entry.label} seed {seed}: {err}") from None
    # Its directory: the registered name, the hyper-parameters off the objective's defaults (in its own order) and a
    # swept training option off the recipe's value; letters, digits and ._=+- kept, anything else '-'.
    hparams = dict(objective.hparams)
    parts = [objective.name] + [f"{key}={canonical_text(hparams[key])}" for key in params
                                if hparams[key] != params[key].default]
    unswept = None
    if option:
        with contextlib.suppress(KeyError, TypeError):  # an option the recipe does not have
            unswept = get_dotted(base, sweep_key)
        if get_dotted(config, sweep_key) != unswept:
            parts.append(f"{sweep_key}={canonical_text(value)}")
    return RunSpec(entry.label, objective.name, seed, hparams, config, sweep_key, value, root,
                   folder=re.sub(r"[^A-Za-z0-9._=+-]", "-", "_".join(parts)))


def plan_runs(objectives: Sequence[str], seeds: Sequence[int], root: str | Path, *, overrides: Sequence[str] = (),
              sweep: Sweep | None = None, base: dict[str, Any] | None = None) -> list[RunSpec]:
    """Every run of the comparison, seed-major (all groups of seed 0 first, so a stopped compare already has
    complete seeds), each validated; each seed's SFT run (when the runs have an SFT stage) comes first. `base` (a
    TrainConfig dict) replaces `base_config(None, overrides)`. Raises ValueError on any bad input."""
    entries = [parse_entry(label) for label in parse_objectives(objectives)]
    if not seeds:
        raise ValueError("no seeds given")
    key, values = sweep or (None, ())
    # (entry, swept key or None): a hyper-parameter sweep applies to the objectives that have it, the others run once
    groups = [(e, key if key and ("." in key or key in e.spec.params) else None) for e in entries]
    if key is not None and not any(swept for _, swept in groups):
        have = "; ".join(f"{e.label}: {', '.join(e.spec.params) or 'none'}" for e in entries)
        raise ValueError(f"--sweep {key}: no compared objective has a hyper-parameter {key!r} "
                         f"({have}); use a dotted key such as rl.learning_rate for a training option")
    base, root = base if base is not None else base_config(None, overrides), Path(root)
    runs = [_make_run(entry, seed, base, swept, value, root)
            for seed in seeds for entry, swept in groups for value in (values if swept else (None,))]
    seen: dict[Path, RunSpec] = {}  # a directory follows from the settings: two groups in one train the same runs
    for spec in runs:
        if (other := seen.setdefault(spec.run_dir, spec)) is not spec:
            raise ValueError(f"{other.group!r} and {spec.group!r} have the same settings ({other.objective} "
                             f"{other.hparams}, {spec.run_dir}); compare each setting once")
    return _share_sft(runs, root) if "sft" in base["stages"] else runs


def _share_sft(runs: list[RunSpec], root: Path) -> list[RunSpec]:
    """One SFT run per distinct SFT config (one per seed unless a swept option changes SFT), just before the first RL
    run that starts from it. Its RL and evaluation sections (unused by SFT) are emptied, so that runs differing only
    there share it and new RL or evaluation defaults keep an existing pool's SFT runs (empty: the defaults)."""
    sft: dict[str, RunSpec] = {}
    out: list[RunSpec] = []
    for spec in runs:
        config = copy.deepcopy(spec.config) | {"stages": ["sft"], "rl": {}, "eval": {}}
        probe = RunSpec("_sft", "sft", spec.seed, {}, config, root=root, kind="sft")
        spec.depends_on = sft.setdefault(probe.fingerprint(), probe)
        spec.config["stages"] = [s for s in spec.config["stages"] if s != "sft"]
        out += [probe, spec] if spec.depends_on is probe else [spec]
    per_seed = Counter(s.seed for s in sft.values())
    for fingerprint, s in sft.items():  # several for one seed (e.g. a sweep over sft.* options): named apart
        if per_seed[s.seed] > 1:
            s.label = f"_sft_{fingerprint[:8]}"
    return out
