"""An experiment as data: groups (an objective as written in `--objectives`, at each swept value) x seeds, each run
a full training config that `trustclip.train.config` validates, as `trustclip train` does.

Everything but the objective, its hyper-parameters, the swept value and the seed is held fixed (the recipe plus the
`--set` overrides). A run's objective hyper-parameters are the recipe's `rl.objective_kwargs` when the recipe trains
that same objective, then the one place that sets a key: a variant's brackets (`clip[epsilon=0.329]`, a group of its
own, named as written), `--hparam OBJECTIVE.KEY=V` or `--sweep KEY=V1,V2` (two of them setting one key is an error).
A sweep key without a dot is an objective hyper-parameter, applied to the objectives that have it (the others run
once, as the sweep's references); a dotted key is a training option applied to every run.

A run's directory follows from its settings: `runs/<objective>[_<key>=<value>...]/seed<k>` with the registered
objective name (`atr` -> `kl3`) and the hyper-parameters that differ from its defaults (numbers normalised: 0.1 =
1e-1, 3 = 3.0), plus a swept training option that differs from the recipe's. So equal settings written differently
share one run in a pool; a run made under the older naming (the group's name as written) is found by its fingerprint.

Shared SFT (default, when the recipe has an `sft` stage): SFT does not depend on the objective, so it runs once per
seed (`runs/_sft/seed<k>`) and every RL run of that seed (stages `rl, eval`) starts from that model, as in the paper.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
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

    label: str  # objective as the user wrote it (e.g. "atr")
    objective: str  # registered name (e.g. "kl3")
    seed: int
    hparams: dict[str, Any]  # resolved objective hyper-parameters (defaults filled in)
    config: dict[str, Any]  # full TrainConfig as a dict (output_dir is set by the worker)
    sweep_key: str | None = None
    sweep_value: Any = None
    root: Path = field(default=Path("."), repr=False)
    kind: str = "rl"  # "rl": a compared run; "sft": a shared SFT run other runs start from
    depends_on: RunSpec | None = field(default=None, repr=False)
    # the group whose run this is when a swept or variant value is the run's own setting (its older directory name)
    stored_as: str | None = None
    folder: str | None = None  # directory under runs/: from the run's settings (`run_folder`), set by plan_runs

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
        return self.root / RUNS_DIR / (self.folder or self.legacy_folder) / f"seed{self.seed}"

    @property
    def legacy_folder(self) -> str:
        """The directory name of releases before issue 27: the (simplest) group's name as written."""
        return safe_name(self.stored_as or self.group)

    def fingerprint(self) -> str:
        """Hash of everything that determines the run's numbers (its SFT run's fingerprint included)."""
        science = {k: v for k, v in self.config.items() if k not in RUN_CONTROL}
        if self.depends_on is not None:
            science["depends_on"] = self.depends_on.fingerprint()
        return hashlib.sha256(json.dumps(science, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """The run_spec.json the worker runs; the SFT model it starts from (if any) relative to its directory, so
        that the pool can be moved."""
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
    """A value as written in a run's directory name: numbers by value (0.1 = 1e-1 -> '0.1', 3 = 3.0 -> '3',
    full precision), anything else as JSON text."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
        return str(int(number)) if number.is_integer() and abs(number) < 1e15 else repr(number)
    return value if isinstance(value, str) else json.dumps(value)


def safe_name(text: str) -> str:
    """A directory name: a variant's 'clip[epsilon=0.3,x=1]' becomes 'clip_epsilon=0.3_x=1'; keeps letters,
    digits and ._=+- ; everything else becomes '-'."""
    text = text.replace("[", "_").replace(",", "_").replace("]", "")
    return re.sub(r"[^A-Za-z0-9._=+-]", "-", text)


# ------------------------------------------------------------------------------------------------ parsing
@dataclass(frozen=True)
class Entry:
    """One item of `--objectives`: an objective name (or alias) as written, with a variant's own
    hyper-parameters, e.g. `clip[epsilon=0.329]`."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    label: str = ""  # the item as written, spaces removed: the group's name


ENTRY = re.compile(r"([A-Za-z0-9_-]+)(?:\[(.*)\])?")


def split_items(text: str) -> list[str]:
    """'clip,clip_higher[epsilon_low=0.3,epsilon_high=0.4]' -> the two items (commas inside brackets stay)."""
    depth = list(itertools.accumulate({"[": 1, "]": -1}.get(ch, 0) for ch in text))
    if any(d not in (0, 1) for d in depth) or depth[-1:] == [1]:
        raise ValueError(f"--objectives {text!r}: unbalanced or nested brackets")
    return [item.strip() for item in re.split(r",(?![^\[]*\])", text) if item.strip()]


def parse_entry(item: str) -> Entry:
    """'clip_higher[epsilon_low=0.3, epsilon_high=0.4]' -> Entry('clip_higher', {...}, 'clip_higher[...]')."""
    from trustclip.objectives.registry import resolve_name

    match = ENTRY.fullmatch(re.sub(r"\s+", "", item))
    if match is None:
        raise ValueError(f"objective {item!r}: expected NAME or NAME[KEY=VALUE,...], e.g. clip[epsilon=0.3]")
    name, inner = match.groups()
    spec = resolve_name(name)  # raises with the list of valid names
    kwargs: dict[str, Any] = {}
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
    """'clip, clip[epsilon=0.3], atr' -> ['clip', 'clip[epsilon=0.3]', 'atr'] (bracket-aware). Rejects unknown
    names and hyper-parameters, an item given twice and one objective listed twice without brackets (aliases
    included); the values themselves are validated with the rest of the run's settings by `plan_runs`."""
    items = split_items(text) if isinstance(text, str) else [t.strip() for t in text if t.strip()]
    if not items:
        raise ValueError("no objectives given; e.g. --objectives clip,atr")
    entries = [parse_entry(item) for item in items]
    seen: dict[str, str] = {}
    for entry in entries:
        canonical = resolve_objective_name(entry.name)
        key = entry.label if entry.kwargs else canonical
        if key in seen:
            same = "the same item" if entry.kwargs else f"the same objective ({canonical})"
            raise ValueError(f"objectives {seen[key]!r} and {entry.label!r} are {same}; give a variant its own "
                             "hyper-parameters, e.g. clip[epsilon=0.3]")
        seen[key] = entry.label
    return [e.label for e in entries]


def resolve_objective_name(name: str) -> str:
    """Registered name of an objective name or alias ('atr' -> 'kl3')."""
    from trustclip.objectives.registry import resolve_name

    return resolve_name(name).name


def resolve_reference(name: str | None, groups: Sequence[tuple[str, str, str]]) -> str:
    """The reference group of the paired comparisons among (group, label, objective) triples in plan order:
    `name` as a group name, an item of --objectives (`clip[epsilon=0.3]`) or an objective name / alias (its
    group, or its one group without brackets); by default the first group of objective `clip`, else the first."""
    groups = list(dict.fromkeys(groups))
    if not groups:
        raise ValueError("no groups to compare")
    if name is None:
        return next((g for g, _, objective in groups if objective == "clip"), groups[0][0])
    candidates = [g for g, _, _ in groups if g == name]
    if not candidates:
        try:
            label = parse_entry(name).label
            candidates = [g for g, lb, _ in groups if lb == label]
            if not candidates and "[" not in name:  # an objective name: its group, or its one plain group
                same = [(g, lb) for g, lb, objective in groups if objective == resolve_objective_name(name)]
                plain = [g for g, lb in same if "[" not in lb]
                candidates = plain if len(same) > 1 and len(plain) == 1 else [g for g, _ in same]
        except ValueError:
            pass
    if len(candidates) == 1:
        return candidates[0]
    listed = ", ".join(g for g, _, _ in groups)
    if candidates:
        raise ValueError(f"--reference {name!r} names {len(candidates)} groups ({', '.join(candidates)}); "
                         "give one of them")
    raise ValueError(f"--reference {name!r} is not a compared group; groups: {listed}")


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


def parse_sweep(text: str | None) -> Sweep | None:
    """'delta=0.03,0.05' -> Sweep('delta', (0.03, 0.05))."""
    if not text:
        return None
    key, sep, raw = text.partition("=")
    key = key.strip()
    values = tuple(parse_value(v.strip()) for v in raw.split(",") if v.strip())
    if not sep or not key or not values:
        raise ValueError(f"--sweep {text!r}: expected KEY=V1,V2,..., e.g. delta=0.03,0.05,0.07")
    _check_sweepable(key, text)
    if any(v is None or isinstance(v, dict | list) for v in values):
        raise ValueError(f"--sweep {text!r}: values must be numbers, strings or booleans")
    if len(set(map(repr, values))) != len(values):
        raise ValueError(f"--sweep {text!r}: repeated values")
    return Sweep(key, values)


# Settings --sweep cannot vary, and what varies them.
NOT_SWEEPABLE = {
    "rl.objective": "list the objectives with --objectives (an objective at other hyper-parameters: NAME[KEY=V])",
    "objective": "list the objectives with --objectives (an objective at other hyper-parameters: NAME[KEY=V])",
    "rl.objective_kwargs": "sweep one hyper-parameter by its name (--sweep delta=0.05,0.1), or list variants "
                           "NAME[KEY=V] in --objectives",
    "seed": "give the seeds with --seeds / --seed-list",
    "stages": "compare runs every stage; set them for all runs with --set stages=...",
}


def _check_sweepable(key: str, text: str) -> None:
    if key.startswith("rl.objective_kwargs."):
        raise ValueError(f"--sweep {text!r}: an objective's hyper-parameter is swept by its name: --sweep "
                         f"{key.rsplit('.', 1)[-1]}=...")
    if key in NOT_SWEEPABLE or key in RUN_CONTROL:
        why = NOT_SWEEPABLE.get(key, "it does not change what a run computes")
        raise ValueError(f"--sweep {text!r}: {key} is not a sweepable setting; {why}")


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


def _recipe_kwargs(entry: Entry, base: dict[str, Any]) -> dict[str, Any]:
    """The recipe's objective_kwargs when the recipe trains this objective, else none."""
    recipe = base["rl"].get("objective")
    same = recipe and resolve_objective_name(recipe) == resolve_objective_name(entry.name)
    return dict(base["rl"].get("objective_kwargs") or {}) if same else {}


def _objective_kwargs(entry: Entry, base: dict[str, Any], extra: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Recipe kwargs (when the recipe trains this objective), then --hparam, then the variant's own values (the two
    never set the same key: `_check_hparams`)."""
    return _recipe_kwargs(entry, base) | extra.get(entry.name, {}) | entry.kwargs


def _check_hparams(entries: Sequence[Entry], hparams: dict[str, dict[str, Any]], sweep: Sweep | None) -> None:
    """A hyper-parameter set twice for one group (a variant's brackets and --hparam, or --hparam and --sweep) would
    leave one of the values silently unused: an error naming both."""
    for entry in entries:
        given = hparams.get(entry.name, {})
        for key in sorted(set(given) & set(entry.kwargs)):
            raise ValueError(f"--hparam {entry.name}.{key}={given[key]!r} and the variant {entry.label!r} both set "
                             f"{key}; give it once (in the brackets, or with --hparam for every group of "
                             f"{entry.name})")
        if sweep is not None and not sweep.is_training_option and sweep.key in given:
            raise ValueError(f"--hparam {entry.name}.{sweep.key}={given[sweep.key]!r} and --sweep {sweep.key} both "
                             f"set {sweep.key}; sweep it or set it, not both")


def _sweep_applies(sweep: Sweep | None, entry: Entry) -> bool:
    from trustclip.objectives.registry import resolve_name

    return sweep is not None and (sweep.is_training_option or sweep.key in resolve_name(entry.name).params)


def _check_sweep(sweep: Sweep | None, entries: Sequence[Entry]) -> None:
    if sweep is None or sweep.is_training_option:
        return
    for entry in entries:
        if sweep.key in entry.kwargs:
            raise ValueError(f"--sweep {sweep.key}: the variant {entry.label!r} sets {sweep.key} itself; "
                             "sweep it or set it, not both")
    if not any(_sweep_applies(sweep, entry) for entry in entries):
        from trustclip.objectives.registry import resolve_name

        have = "; ".join(f"{e.label}: {', '.join(resolve_name(e.name).params) or 'none'}" for e in entries)
        raise ValueError(f"--sweep {sweep.key}: no compared objective has a hyper-parameter {sweep.key!r} "
                         f"({have}); use a dotted key such as rl.learning_rate for a training option")


def _make_run(entry: Entry, seed: int, base: dict[str, Any], hparams: dict[str, dict[str, Any]],
              sweep: Sweep | None, value: Any, root: Path) -> RunSpec:
    """The run of `entry` at `seed` (and swept `value`). A run whose settings are those of a simpler group (a
    swept value or a variant's value that is the objective's own: `atr_delta=0.07`, `clip[epsilon=0.2]`) is
    stored where that group's run is, with its fingerprint, so a pool makes it once whichever name asks for it."""
    run = _build_run(entry, seed, base, _objective_kwargs(entry, base, hparams), sweep, value, root)
    simpler = [Entry(entry.name, {}, entry.name)] if entry.kwargs else []  # the plain objective first
    if sweep is not None:
        simpler.append(entry)  # then the same item unswept
    for other_entry in simpler:
        other = _build_run(other_entry, seed, base, _objective_kwargs(other_entry, base, hparams), None, None, root)
        if _settings(other) == _settings(run):
            return replace(run, config=other.config, stored_as=other.group)
    return run


def _build_run(entry: Entry, seed: int, base: dict[str, Any], kwargs: dict[str, Any], sweep: Sweep | None,
               value: Any, root: Path) -> RunSpec:
    import copy

    from trustclip.objectives import get_objective
    from trustclip.train.config import TrainConfig, from_dict, set_dotted

    data, kwargs = copy.deepcopy(base), dict(kwargs)
    if sweep is not None and sweep.is_training_option:
        set_dotted(data, sweep.key, value)
    elif sweep is not None:
        kwargs[sweep.key] = value
    try:
        objective = get_objective(entry.name, **kwargs)
    except ValueError as err:
        raise ValueError(f"objective {entry.label!r}: {err}") from None
    data["seed"] = seed
    data["rl"] |= {"objective": objective.name,
                   "objective_kwargs": _canonical_kwargs(objective, kwargs, _recipe_kwargs(entry, base))}
    try:
        config = from_dict(TrainConfig, data).to_dict()
    except ValueError as err:
        raise ValueError(f"run {entry.label} seed {seed}: {err}") from None
    return RunSpec(entry.label, objective.name, seed, dict(objective.hparams), config,
                   sweep.key if sweep is not None else None, value, root)


def _canonical_kwargs(objective: Any, kwargs: dict[str, Any], recipe: dict[str, Any]) -> dict[str, Any]:
    """The kwargs a run's config records, the same however they were written: a value equal to the objective's
    default is left out (unless it overrides the recipe's), an integer given for a float parameter is that float."""
    defaults = {key: param.default for key, param in objective.spec.params.items()}
    out = {}
    for key, value in kwargs.items():
        if isinstance(defaults.get(key), float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if key in recipe or value != defaults.get(key):
            out[key] = value
    return out


def run_folder(spec: RunSpec, base: dict[str, Any]) -> str:
    """A run's directory name from its settings: the registered objective name, its hyper-parameters that differ from
    the objective's defaults (in its own order) and a swept training option that differs from the recipe's value."""
    from trustclip.objectives.registry import resolve_name
    from trustclip.train.config import get_dotted

    params = resolve_name(spec.objective).params
    parts = [spec.objective] + [f"{key}={canonical_text(spec.hparams[key])}" for key in params
                                if key in spec.hparams and spec.hparams[key] != params[key].default]
    if spec.sweep_key is not None and "." in spec.sweep_key:
        try:
            unswept = get_dotted(base, spec.sweep_key)
        except (KeyError, TypeError):
            unswept = None
        if get_dotted(spec.config, spec.sweep_key) != unswept:
            parts.append(f"{spec.sweep_key}={canonical_text(spec.sweep_value)}")
    return safe_name("_".join(parts))


def _place(spec: RunSpec, base: dict[str, Any]) -> None:
    """Set the run's directory: the one its settings name, or the older one (the group's name) where a run with
    exactly its fingerprint already is (a pool made before issue 27)."""
    from trustclip.files import read_json

    spec.folder = run_folder(spec, base)
    canonical, legacy = spec.run_dir, spec.root / RUNS_DIR / spec.legacy_folder / f"seed{spec.seed}"
    if legacy != canonical and not canonical.exists():
        old = read_json(legacy / SPEC_FILE)
        if isinstance(old, dict) and old.get("fingerprint") == spec.fingerprint():
            spec.folder = spec.legacy_folder


def _settings(spec: RunSpec) -> str:
    """What determines a run's numbers, with the objective's defaults filled in (so clip == clip[epsilon=0.2])."""
    science = {**spec.config, "rl": {**spec.config["rl"], "objective_kwargs": spec.hparams}}
    return json.dumps({k: v for k, v in science.items() if k not in RUN_CONTROL}, sort_keys=True, default=str)


def _check_distinct(runs: Sequence[RunSpec]) -> None:
    """Two groups that would train the same runs (same settings once the objective's defaults are filled in),
    or write to the same directory, are an error."""
    seen: dict[str, RunSpec] = {}
    for spec in runs:
        for key in (f"settings {_settings(spec)}", f"directory {spec.run_dir}"):
            other = seen.setdefault(key, spec)
            if other is not spec:
                what = key.split()[0]
                raise ValueError(f"{other.group!r} and {spec.group!r} have the same {what} "
                                 f"({other.objective} {other.hparams}); compare each setting once")


def plan_runs(objectives: Sequence[str], seeds: Sequence[int], root: str | Path, *,
              recipe: str | Path | None = None, overrides: Sequence[str] = (), sweep: Sweep | None = None,
              hparams: dict[str, dict[str, Any]] | None = None, base: dict[str, Any] | None = None,
              share_sft: bool = True) -> list[RunSpec]:
    """Every run of the comparison, seed-major (all objectives of seed 0 first, so a stopped compare
    already has complete seeds), each validated; with `share_sft`, each seed's SFT run comes first. `base`
    (a TrainConfig dict) replaces recipe + overrides. Raises ValueError on any bad input."""
    entries = [parse_entry(label) for label in parse_objectives(objectives)]
    if not seeds:
        raise ValueError("no seeds given")
    _check_sweep(sweep, entries)
    _check_hparams(entries, hparams or {}, sweep)
    base = base if base is not None else base_config(recipe, overrides)
    root = Path(root)
    runs: list[RunSpec] = []
    for seed in seeds:
        for entry in entries:
            if sweep is not None and _sweep_applies(sweep, entry):
                runs.extend(_make_run(entry, seed, base, hparams or {}, sweep, v, root) for v in sweep.values)
            else:
                runs.append(_make_run(entry, seed, base, hparams or {}, None, None, root))
    for spec in runs:
        spec.folder = run_folder(spec, base)
    _check_distinct(runs)
    if share_sft and "sft" in base["stages"]:
        runs = _share_sft(runs, root)
    for spec in runs:
        if spec.kind == "rl":
            _place(spec, base)  # its fingerprint includes its SFT run's
    return runs


def _sft_config(config: dict[str, Any]) -> dict[str, Any]:
    """The SFT-only config of a run: its RL and evaluation sections (unused by SFT) emptied, so that runs
    differing only there share one SFT run, and a release that changes the RL or evaluation defaults
    keeps the SFT runs of an existing comparison (an empty section means the defaults)."""
    import copy

    return copy.deepcopy(config) | {"stages": ["sft"], "rl": {}, "eval": {}}


def _share_sft(runs: list[RunSpec], root: Path) -> list[RunSpec]:
    """Insert one SFT run per distinct SFT config (one per seed unless a swept option changes SFT) and make
    the RL runs start from it."""
    sft: dict[str, RunSpec] = {}
    by_seed: dict[int, list[str]] = {}
    for spec in runs:
        probe = RunSpec("_sft", "sft", spec.seed, {}, _sft_config(spec.config), root=root, kind="sft")
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
    for spec in runs:  # each SFT run before the first RL run that starts from it
        out += [spec] if any(s is spec.depends_on for s in out) else [spec.depends_on, spec]
    return out
