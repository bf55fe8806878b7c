"""An experiment as data: groups x seeds, each run a full training config validated as `trustclip train` validates it.

A group is an item of `--objectives` (`clip`, or a variant `clip[epsilon=0.329]`, named as written) at each value of
`--sweep`; all else is the recipe plus `--set`. Its hyper-parameters: the recipe's `rl.objective_kwargs` when the recipe
trains that objective, then the one place that sets a key (brackets, `--hparam OBJECTIVE.KEY=V` or `--sweep KEY=V,..`;
two setting one key is an error). A sweep key without a dot applies to the objectives that have it (the others run once,
as references); a dotted key is a training option of every run. A run's directory follows from its settings
(`run_folder`), so equal settings written differently share one run of a pool; with shared SFT (default) SFT runs once
per seed in `runs/_sft/seed<k>` and that seed's RL runs (stages `rl, eval`) start from its model, as in the paper.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trustclip.train.config import RUN_CONTROL, parse_value

RUNS_DIR = "runs"
SPEC_FILE = "run_spec.json"


@dataclass(frozen=True)
class Sweep:
    """One swept setting: an objective hyper-parameter (`delta`) or a dotted training option."""

    key: str
    values: tuple[Any, ...]

    @property
    def is_training_option(self) -> bool:
        return "." in self.key


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
    folder: str = ""  # directory under runs/: `run_folder` (an SFT run: its label)

    @property
    def group(self) -> str:
        """Name of the (objective, sweep value) group that seeds are aggregated over."""
        if self.kind == "sft" or self.sweep_key is None:
            return self.label
        return f"{self.label}_{self.sweep_key}={format_value(self.sweep_value)}"

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


def format_value(value: Any) -> str:
    """Short, stable text of a swept value: 0.07 -> '0.07', 1e-05 -> '1e-05'."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def canonical_text(value: Any) -> str:
    """A value in a directory name: numbers by value (0.1 = 1e-1 -> '0.1', 3 = 3.0 -> '3', full precision)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
        return str(int(number)) if number.is_integer() and abs(number) < 1e15 else repr(number)
    return value if isinstance(value, str) else json.dumps(value)


def _objective(name: str) -> Any:
    """The registered objective of a name or alias (raises naming the valid ones)."""
    from trustclip.objectives.registry import resolve_name  # imports torch: not before a name is resolved

    return resolve_name(name)


# ------------------------------------------------------------------------------------------------ parsing
@dataclass(frozen=True)
class Entry:
    """One item of `--objectives`: an objective name (or alias) with a variant's own hyper-parameters."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    label: str = ""  # the item as written, spaces removed: the group's name


def parse_entry(item: str) -> Entry:
    """'clip_higher[epsilon_low=0.3, epsilon_high=0.4]' -> Entry('clip_higher', {...}, 'clip_higher[...]')."""
    match = re.fullmatch(r"([A-Za-z0-9_-]+)(?:\[(.*)\])?", re.sub(r"\s+", "", item))
    if match is None:
        raise ValueError(f"objective {item!r}: expected NAME or NAME[KEY=VALUE,...], e.g. clip[epsilon=0.3]")
    name, inner = match.groups()
    spec, kwargs = _objective(name), {}
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
    return Entry(name, kwargs, match.group(0))


def parse_objectives(text: str | Sequence[str]) -> list[str]:
    """'clip, clip[epsilon=0.3], atr' -> ['clip', 'clip[epsilon=0.3]', 'atr'] (commas inside brackets stay).
    Rejects unknown names and hyper-parameters, an item given twice and one objective listed twice without brackets
    (aliases included); the values are validated with the rest of the run's settings by `plan_runs`."""
    if isinstance(text, str):
        depth = list(itertools.accumulate({"[": 1, "]": -1}.get(ch, 0) for ch in text))
        if any(d not in (0, 1) for d in depth) or depth[-1:] == [1]:
            raise ValueError(f"--objectives {text!r}: unbalanced or nested brackets")
        text = re.split(r",(?![^\[]*\])", text)
    seen: dict[str, str] = {}  # an objective (or a variant as written) -> its item
    for entry in (parse_entry(item) for item in text if item.strip()):
        key = entry.label if entry.kwargs else _objective(entry.name).name
        if key in seen:
            same = "the same item" if entry.kwargs else f"the same objective ({key})"
            raise ValueError(f"objectives {seen[key]!r} and {entry.label!r} are {same}; give a variant its own "
                             "hyper-parameters, e.g. clip[epsilon=0.3]")
        seen[key] = entry.label
    if not seen:
        raise ValueError("no objectives given; e.g. --objectives clip,atr")
    return list(seen.values())


def resolve_reference(name: str | None, groups: Sequence[tuple[str, str, str]]) -> str:
    """The reference group among (group, label, objective) triples in plan order: `name` as a group name, an item of
    --objectives (`clip[epsilon=0.3]`) or an objective name / alias (its group, or its one group without brackets);
    by default the first group of objective `clip`, else the first."""
    groups = list(dict.fromkeys(groups))
    if not groups:
        raise ValueError("no groups to compare")
    if name is None:
        return next((g for g, _, objective in groups if objective == "clip"), groups[0][0])
    candidates = [g for g, _, _ in groups if g == name]
    with contextlib.suppress(ValueError):  # not an item of --objectives: no other match
        label = parse_entry(name).label
        candidates = candidates or [g for g, lb, _ in groups if lb == label]
        if not candidates and "[" not in name:  # an objective name: its group, or its one plain group
            same = [(g, lb) for g, lb, objective in groups if objective == _objective(name).name]
            plain = [g for g, lb in same if "[" not in lb]
            candidates = plain if len(same) > 1 and len(plain) == 1 else [g for g, _ in same]
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        raise ValueError(f"--reference {name!r} names {len(candidates)} groups ({', '.join(candidates)}); "
                         "give one of them")
    raise ValueError(f"--reference {name!r} is not a compared group; groups: {', '.join(g for g, _, _ in groups)}")


def parse_seeds(count: int | None = None, seed_list: str | None = None) -> list[int]:
    """`count` seeds 0..count-1, or an explicit comma-separated list."""
    if seed_list:
        try:
            seeds = [int(s) for s in seed_list.split(",") if s.strip()]
        except ValueError:
            raise ValueError(f"--seed-list {seed_list!r}: expected integers like 0,1,2") from None
        if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
            raise ValueError(f"--seed-list {seed_list!r}: need distinct non-negative integers")
        return seeds
    if count is None or isinstance(count, bool) or count < 1:
        raise ValueError(f"--seeds must be an integer >= 1, got {count!r}")
    return list(range(count))


_LIST = "list the objectives with --objectives (an objective at other hyper-parameters: NAME[KEY=V])"
NOT_SWEEPABLE = {  # settings --sweep cannot vary, and what varies them
    "rl.objective": _LIST, "objective": _LIST, "seed": "give the seeds with --seeds / --seed-list",
    "rl.objective_kwargs": "sweep one hyper-parameter by its name (--sweep delta=0.05,0.1), or list variants "
                           "NAME[KEY=V] in --objectives",
    "stages": "compare runs every stage; set them for all runs with --set stages=...",
}


def parse_sweep(text: str | None) -> Sweep | None:
    """'delta=0.03,0.05' -> Sweep('delta', (0.03, 0.05))."""
    if not text:
        return None
    key, sep, raw = text.partition("=")
    key, values = key.strip(), tuple(parse_value(v.strip()) for v in raw.split(",") if v.strip())
    if not sep or not key or not values:
        raise ValueError(f"--sweep {text!r}: expected KEY=V1,V2,..., e.g. delta=0.03,0.05,0.07")
    if key.startswith("rl.objective_kwargs."):
        raise ValueError(f"--sweep {text!r}: an objective's hyper-parameter is swept by its name: --sweep "
                         f"{key.rsplit('.', 1)[-1]}=...")
    if key in NOT_SWEEPABLE or key in RUN_CONTROL:
        why = NOT_SWEEPABLE.get(key, "it does not change what a run computes")
        raise ValueError(f"--sweep {text!r}: {key} is not a sweepable setting; {why}")
    if any(v is None or isinstance(v, dict | list) for v in values):
        raise ValueError(f"--sweep {text!r}: values must be numbers, strings or booleans")
    if len(set(map(repr, values))) != len(values):
        raise ValueError(f"--sweep {text!r}: repeated values")
    return Sweep(key, values)


def parse_hparams(items: Sequence[str], labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """['clip.epsilon=0.3'] -> {'clip': {'epsilon': 0.3}}; the objective must be one of the compared names
    (`labels`: items of --objectives; a variant's name is the part before its brackets)."""
    compared = list(dict.fromkeys(parse_entry(label).name for label in labels))
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        target, sep, raw = item.partition("=")
        label, dot, key = target.strip().partition(".")
        if not sep or not dot or not label or not key:
            raise ValueError(f"--hparam {item!r}: expected OBJECTIVE.KEY=VALUE, e.g. clip.epsilon=0.3")
        if label not in compared:
            raise ValueError(f"--hparam {item!r}: objective {label!r} is not compared; compared: {', '.join(compared)}")
        if key in out.get(label, {}):
            raise ValueError(f"--hparam {item!r}: {label}.{key} is given twice; give it once")
        out.setdefault(label, {})[key] = parse_value(raw.strip())
    return out


# ----------------------------------------------------------------------------------------------- planning
def base_config(recipe: str | Path | None, overrides: Sequence[str]) -> dict[str, Any]:
    """Recipe (with its `base:` chain) + `--set` overrides, as the trainer resolves them, as a nested dict."""
    from trustclip.train.config import load_config, parse_override

    for text in overrides:
        key = parse_override(text)[0]
        if key in ("seed", "output_dir", "resume", "rl.objective", "rl.objective_kwargs"):
            raise ValueError(f"--set {text!r}: {key} is set by compare itself (use --objectives/--seeds/--hparam)")
    return load_config(recipe, list(overrides)).to_dict()


def _sweep_applies(sweep: Sweep | None, entry: Entry) -> bool:
    return sweep is not None and (sweep.is_training_option or sweep.key in _objective(entry.name).params)


def _make_run(entry: Entry, seed: int, base: dict[str, Any], hparams: dict[str, dict[str, Any]],
              sweep: Sweep | None, value: Any, root: Path) -> RunSpec:
    """The run of `entry` at `seed` (and swept `value`), its config validated by TrainConfig itself. A value set in
    two places (brackets, --hparam, --sweep) would leave one silently unused: an error naming both."""
    from trustclip.objectives import get_objective
    from trustclip.train.config import TrainConfig, from_dict, set_dotted

    given = hparams.get(entry.name, {})
    for key in sorted(set(given) & set(entry.kwargs)):
        raise ValueError(f"--hparam {entry.name}.{key}={given[key]!r} and the variant {entry.label!r} both set {key}; "
                         f"give it once (in the brackets, or with --hparam for every group of {entry.name})")
    same = base["rl"].get("objective") and _objective(base["rl"]["objective"]).name == _objective(entry.name).name
    recipe = dict(base["rl"].get("objective_kwargs") or {}) if same else {}  # the recipe's, for its own objective
    data, kwargs = copy.deepcopy(base), recipe | given | entry.kwargs
    if sweep is not None and sweep.is_training_option:
        set_dotted(data, sweep.key, value)
    elif sweep is not None:
        if sweep.key in entry.kwargs:
            raise ValueError(f"--sweep {sweep.key}: the variant {entry.label!r} sets {sweep.key} itself; "
                             "sweep it or set it, not both")
        if sweep.key in given:
            raise ValueError(f"--hparam {entry.name}.{sweep.key}={given[sweep.key]!r} and --sweep {sweep.key} both "
                             f"set {sweep.key}; sweep it or set it, not both")
        kwargs[sweep.key] = value
    try:
        objective = get_objective(entry.name, **kwargs)
    except ValueError as err:
        raise ValueError(f"objective {entry.label!r}: {err}") from None
    # The kwargs the config records are the same however they were written, so that equal settings have one
    # fingerprint: a value equal to the objective's default is left out (unless it overrides the recipe's), an
    # integer given for a float parameter is that float.
    defaults = {key: param.default for key, param in objective.spec.params.items()}
    canonical = {key: float(v) if isinstance(defaults.get(key), float) and type(v) is int else v
                 for key, v in kwargs.items()}
    data["seed"] = seed
    data["rl"] |= {"objective": objective.name,
                   "objective_kwargs": {k: v for k, v in canonical.items() if k in recipe or v != defaults.get(k)}}
    try:
        config = from_dict(TrainConfig, data).to_dict()
    except ValueError as err:
        raise ValueError(f"run {entry.label} seed {seed}: {err}") from None
    return RunSpec(entry.label, objective.name, seed, dict(objective.hparams), config,
                   sweep.key if sweep is not None else None, value, root)


def run_folder(spec: RunSpec, base: dict[str, Any]) -> str:
    """A run's directory name from its settings: the registered objective name, its hyper-parameters that differ from
    the objective's defaults (in its own order) and a swept training option that differs from the recipe's value;
    letters, digits and ._=+- kept, anything else '-'."""
    from trustclip.train.config import get_dotted

    params = _objective(spec.objective).params
    parts = [spec.objective] + [f"{key}={canonical_text(spec.hparams[key])}" for key in params
                                if key in spec.hparams and spec.hparams[key] != params[key].default]
    if spec.sweep_key is not None and "." in spec.sweep_key:
        try:
            unswept = get_dotted(base, spec.sweep_key)
        except (KeyError, TypeError):
            unswept = None
        if get_dotted(spec.config, spec.sweep_key) != unswept:
            parts.append(f"{spec.sweep_key}={canonical_text(spec.sweep_value)}")
    return re.sub(r"[^A-Za-z0-9._=+-]", "-", "_".join(parts))


def plan_runs(objectives: Sequence[str], seeds: Sequence[int], root: str | Path, *,
              recipe: str | Path | None = None, overrides: Sequence[str] = (), sweep: Sweep | None = None,
              hparams: dict[str, dict[str, Any]] | None = None, base: dict[str, Any] | None = None,
              share_sft: bool = True) -> list[RunSpec]:
    """Every run of the comparison, seed-major (all groups of seed 0 first, so a stopped compare already has
    complete seeds), each validated; with `share_sft`, each seed's SFT run comes first. `base` (a TrainConfig dict)
    replaces recipe + overrides. Raises ValueError on any bad input."""
    entries = [parse_entry(label) for label in parse_objectives(objectives)]
    if not seeds:
        raise ValueError("no seeds given")
    if sweep is not None and not any(_sweep_applies(sweep, entry) for entry in entries):
        have = "; ".join(f"{e.label}: {', '.join(_objective(e.name).params) or 'none'}" for e in entries)
        raise ValueError(f"--sweep {sweep.key}: no compared objective has a hyper-parameter {sweep.key!r} "
                         f"({have}); use a dotted key such as rl.learning_rate for a training option")
    hparams, base = hparams or {}, base if base is not None else base_config(recipe, overrides)
    root, runs = Path(root), []
    for seed in seeds:
        for entry in entries:
            swept = _sweep_applies(sweep, entry)
            runs += [_make_run(entry, seed, base, hparams, sweep if swept else None, value, root)
                     for value in (sweep.values if swept else (None,))]
    seen: dict[Path, RunSpec] = {}  # a directory follows from the settings: two groups in one train the same runs
    for spec in runs:
        spec.folder = run_folder(spec, base)
        if (other := seen.setdefault(spec.run_dir, spec)) is not spec:
            raise ValueError(f"{other.group!r} and {spec.group!r} have the same settings ({other.objective} "
                             f"{other.hparams}, {spec.run_dir}); compare each setting once")
    return _share_sft(runs, root) if share_sft and "sft" in base["stages"] else runs


def _share_sft(runs: list[RunSpec], root: Path) -> list[RunSpec]:
    """One SFT run per distinct SFT config (one per seed unless a swept option changes SFT), each before the first RL
    run that starts from it. Its RL and evaluation sections (unused by SFT) are emptied, so that runs differing only
    there share it and new RL or evaluation defaults keep an existing pool's SFT runs (empty: the defaults)."""
    sft: dict[str, RunSpec] = {}
    by_seed: dict[int, list[str]] = {}
    for spec in runs:
        config = copy.deepcopy(spec.config) | {"stages": ["sft"], "rl": {}, "eval": {}}
        probe = RunSpec("_sft", "sft", spec.seed, {}, config, root=root, kind="sft")
        if probe.fingerprint() not in sft:
            sft[probe.fingerprint()] = probe
            by_seed.setdefault(spec.seed, []).append(probe.fingerprint())
        spec.depends_on = sft[probe.fingerprint()]
        spec.config["stages"] = [s for s in spec.config["stages"] if s != "sft"]
    for fingerprints in by_seed.values():
        if len(fingerprints) > 1:  # e.g. a sweep over sft.* options: one SFT run per value
            for fp in fingerprints:
                sft[fp].label = f"_sft_{fp[:8]}"
    out: list[RunSpec] = []
    for spec in runs:
        out += [spec] if any(s is spec.depends_on for s in out) else [spec.depends_on, spec]
    return out
