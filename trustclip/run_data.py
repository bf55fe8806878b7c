"""The rows a run reads (SFT, RL and the benchmarks of `trustclip train`, the benchmarks of `trustclip eval`): files /
hub datasets through `trustclip.data.load_prompts`, and the built-in synthetic task
with the levels and sizes of `config.data` (the default run trains on a subset of the levels)."""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Any

from trustclip.data.loaders import BUILTIN_PREFIX, load_prompts, parse_benchmark_spec, select_rows
from trustclip.data.synthetic import DEFAULT_EVAL_SPLITS, LEVELS, make_synthetic_splits
from trustclip.settings import TrainConfig


def load_rows(source: str, config: TrainConfig, *, split: str, subset: str | None = None, limit: int | None = None,
              problem_key: str | None = None, answer_key: str | None = None) -> list[dict[str, Any]]:
    """Rows `{"id", "problem", "answer", ...}` of a file, hub dataset, or `builtin:<split>`."""
    d = config.data
    if source.startswith(BUILTIN_PREFIX):  # a known split (input_checks.check_source)
        splits = _synthetic(d.seed, d.builtin_n_train, d.builtin_n_eval, tuple(d.builtin_train_levels),
                            d.builtin_max_operand)
        return splits[source.split(":", 1)[1]][:limit]
    return load_prompts(source, split=split, subset=subset, problem_key=problem_key or d.problem_key,
                        answer_key=answer_key or d.answer_key, limit=limit, seed=d.seed)


@lru_cache(maxsize=4)
def _synthetic(seed: int, n_train: int, n_eval: int, levels: tuple[int, ...], max_operand: int | None) -> dict:
    def level(k: int) -> Any:  # data.builtin_train_levels is checked (DataArgs)
        return LEVELS[k] if max_operand is None else dataclasses.replace(LEVELS[k], hi=max_operand)

    evals = {name: [level(k) for k in lvs] for name, lvs in DEFAULT_EVAL_SPLITS.items()}
    return make_synthetic_splits(seed, n_train, n_eval, train_levels=[level(k) for k in levels], eval_splits=evals)


def load_benchmarks(config: TrainConfig) -> dict[str, list[dict[str, Any]]]:
    """`data.eval` specs (checked by `input_checks.check_benchmarks`) -> {name: rows}. Built-in splits come from this
    run's synthetic task (its levels, operand range and seed); `data.eval_limit` applies last."""
    d, out = config.data, {}
    for bench in (bench for spec in d.eval for bench in parse_benchmark_spec(spec)):
        if bench.name in out:  # a library caller that skipped check_benchmarks: no benchmark silently replaced
            raise ValueError(f"data.eval: benchmark name {bench.name!r} given twice")
        out[bench.name] = select_rows(load_rows(bench.source, config, split=d.eval_split), bench)[: d.eval_limit]
    return out
