"""Load prompt rows `{"id", "problem", "answer", ...}` from local files, the hub, or the synthetic task.

A source is a local `.jsonl` / `.ndjson`, `.json` (an array of objects, `{"data": [...]}`, or JSON Lines) or `.parquet`
file; `builtin:<split>`, a split of the synthetic task (`builtin:train`, `builtin:amc_like`, ...); anything else is a
Hugging Face hub dataset id, loaded with `datasets.load_dataset` (needs internet).

Field names are configurable (`problem_key`, `answer_key`, `id_key`). Two hub layouts are recognised too:
- verl/DAPO-Math-17k (`prompt` = chat messages, `reward_model.ground_truth`, `extra_info.index`) when the problem
  field is absent; DAPO's own "Answer:" instruction wrapper is stripped, since our templates ask for `\\boxed{}`;
- GSM8K (`answer` = worked solution, then `#### N`; the problem in `question` when the problem field is absent, as in
  openai/gsm8k): the answer becomes N and, unless the record has one, `solution` the worked solution (calculator
  annotations `<<...>>` removed) ending in `\\boxed{N}`: an SFT target in the format the reward requires.
Every record is validated while loading, so a malformed file fails with `DataFormatError` naming the file and line
before any training starts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from trustclip.data.synthetic import DEFAULT_EVAL_SPLITS, make_synthetic_splits

JSONL_SUFFIXES = {".jsonl", ".ndjson"}
FILE_SUFFIXES = JSONL_SUFFIXES | {".json", ".parquet"}
BUILTIN_PREFIX = "builtin:"
TEXT_FIELDS = ("id", "problem", "answer")  # fields every loaded row holds as text
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
GSM8K_ANSWER = re.compile(r"\n#### ([^\n]+?)\s*$")  # GSM8K's answer field: worked solution, then "#### N"
GSM8K_CALCULATOR = re.compile(r"<<[^>]*>>")
_JSON_SPACE = re.compile(r"[ \t\r\n]*")


class DataFormatError(ValueError):
    """A data file or record that cannot be used; the message names the file and line (or row)."""


def load_prompts(source: str | os.PathLike, *, split: str = "train", subset: str | None = None,
                 problem_key: str = "problem", answer_key: str = "answer", id_key: str = "id", limit: int | None = None,
                 seed: int = 0) -> list[dict[str, Any]]:
    """Validated rows `{"id": str, "problem": str, "answer": str, **scalar extra fields}` from a local file,
    `builtin:<split>` (`seed`) or a hub dataset id (`split`, `subset`); `limit` keeps the first rows."""
    keys = (problem_key, answer_key, id_key)
    source_str = str(source)
    if source_str.startswith(BUILTIN_PREFIX):
        rows = _load_builtin(source_str[len(BUILTIN_PREFIX) :], seed)
    elif (path := Path(source_str).expanduser()).exists():  # `~` as check_source reads it
        rows = _load_file(path, keys)
    elif Path(source_str).suffix.lower() in FILE_SUFFIXES or source_str.startswith((".", "/", "~")):
        raise FileNotFoundError(f"data file not found: {source_str}")
    else:
        rows = _load_hub(source_str, split, subset, keys)
    return rows[:limit] if limit is not None else rows


@dataclass(frozen=True)
class BenchmarkSpec:
    """One benchmark of a spec: its name, its source, and the rows it keeps: `filters` holds (field, values) pairs,
    and a row is kept when, for every pair, its field equals one of the values (as JSON values); all rows if empty."""

    name: str
    source: str
    filters: tuple[tuple[str, tuple[Any, ...]], ...] = ()


def parse_benchmark_spec(spec: str) -> list[BenchmarkSpec]:
    """`NAME=SOURCE`, a bare `SOURCE` (named after the file stem) or `builtin` (every held-out synthetic split), each
    optionally followed by `?FIELD=V1,V2[&FIELD2=...]` to keep some rows (`select_rows`; e.g. MATH-500's levels 1-2:
    `math500_l12=math500.jsonl?level=1,2`). Raises ValueError on a malformed spec; loads nothing."""
    body, _, query = spec.partition("?")
    filters = _parse_filters(spec, query) if query else ()
    if body == "builtin":
        pairs = [(name, BUILTIN_PREFIX + name) for name in DEFAULT_EVAL_SPLITS]
    elif "=" in body:
        name, _, source = body.partition("=")
        if not name or not source:
            raise ValueError(f"bad benchmark spec {spec!r}: expected NAME=FILE")
        pairs = [(name, source)]
    else:
        pairs = [(Path(body).stem if Path(body).suffix else body.rsplit(":", 1)[-1], body)]
    return [BenchmarkSpec(name, source, filters) for name, source in pairs]


def _parse_filters(spec: str, query: str) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """`level=1,2&subject=Algebra` -> (("level", (1, 2)), ("subject", ("Algebra",))). A value is read as JSON when it
    is JSON (1, 1.5, true, null, "text"), else taken as text; `%26`, `%2C`, `%3D` write a literal `&`, `,`, `=`."""
    filters: dict[str, tuple[Any, ...]] = {}
    for part in query.split("&"):
        key, sep, listed = part.partition("=")
        key = unquote(key.strip())
        values = tuple(_json_value(unquote(v.strip())) for v in listed.split(",") if v.strip())
        if not sep or not key or not values:
            raise ValueError(f"bad benchmark spec {spec!r}: expected NAME=SOURCE?FIELD=VALUE[,VALUE...][&FIELD=...], "
                             f"got {part!r}")
        if key in filters:
            raise ValueError(f"bad benchmark spec {spec!r}: field {key!r} is given twice; list its values once "
                             f"({key}=V1,V2)")
        if bad := [v for v in values if isinstance(v, list | dict)]:
            raise ValueError(f"bad benchmark spec {spec!r}: {key}={json.dumps(bad[0])} is not a single value (a "
                             "number, string, true/false or null)")
        filters[key] = values
    return tuple(filters.items())


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _matches(key: str, row_value: Any, wanted: Any) -> bool:
    """A row's field equals a filter value as JSON values (1 == 1.0, but neither true == 1 nor "1" == 1); the fields
    the loader turns into text (id, problem, answer: a source's 7 is "7") also match a number by its text."""
    if key in TEXT_FIELDS and isinstance(row_value, str) and not isinstance(wanted, str):
        return row_value == json.dumps(wanted)
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (row_value, wanted))
    return row_value == wanted and (numbers or type(row_value) is type(wanted))


def select_rows(rows: list[dict[str, Any]], bench: BenchmarkSpec) -> list[dict[str, Any]]:
    """The rows a spec's filters keep (every row without one). A field no row has, a listed value no row has, or a
    combination that keeps no row is a ValueError naming it."""
    if not bench.filters:
        return rows
    query = "&".join(f"{key}={','.join(json.dumps(v) for v in values)}" for key, values in bench.filters)
    spec = f"{bench.name}={bench.source}?{query}"
    kept = rows
    for key, values in bench.filters:
        if not any(key in r for r in rows):
            fields = ", ".join(sorted(rows[0])) if rows else "none"
            raise ValueError(f"benchmark spec {spec!r}: no row has a field {key!r} (fields: {fields})")
        present = {json.dumps(r[key]): r[key] for r in rows if key in r}
        if missing := [v for v in values if not any(_matches(key, p, v) for p in present.values())]:
            shown = ", ".join(sorted(present)[:20]) + (", ..." if len(present) > 20 else "")
            raise ValueError(f"benchmark spec {spec!r}: no row has {key} in {json.dumps(missing)} (values of {key}: "
                             f"{shown}); drop the value or fix its spelling (a string that looks like a number is "
                             'written in quotes, e.g. "1")')
        kept = [r for r in kept if key in r and any(_matches(key, r[key], v) for v in values)]
    if not kept:
        raise ValueError(f"benchmark spec {spec!r}: no row matches every filter at once")
    return kept


def load_benchmark_specs(specs: Sequence[str], *, limit: int | None = None,
                         **kwargs: Any) -> dict[str, list[dict[str, Any]]]:
    """Parse CLI benchmark specs (`parse_benchmark_spec`) into `{name: rows}`, the first `limit` rows of each after
    the row selection. `kwargs` go to `load_prompts`."""
    out: dict[str, list[dict[str, Any]]] = {}
    for spec in specs:
        for bench in parse_benchmark_spec(spec):
            if bench.name in out:
                raise ValueError(f"benchmark name {bench.name!r} given twice")
            rows = select_rows(load_prompts(bench.source, **kwargs), bench)
            out[bench.name] = rows[:limit] if limit is not None else rows
    return out


def _load_builtin(split: str, seed: int) -> list[dict[str, Any]]:
    known = ["train", *DEFAULT_EVAL_SPLITS]
    if split not in known:
        raise ValueError(f"unknown builtin split {split!r}; choose from {known}")
    return make_synthetic_splits(seed=seed, n_train=2000 if split == "train" else 0)[split]


def _load_file(path: Path, keys: tuple[str, str, str]) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    reader = {".json": _iter_json, ".parquet": _iter_parquet, **dict.fromkeys(JSONL_SUFFIXES, _iter_jsonl)}.get(suffix)
    if reader is None:
        raise DataFormatError(f"{path}: unsupported file type {suffix!r}; use .jsonl, .json or .parquet")
    rows = [_normalize(rec, where, keys, default_id=f"{path.stem}-{i}") for i, (where, rec) in enumerate(reader(path))]
    if not rows:
        raise DataFormatError(f"{path}: empty file (no records)")
    return rows


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as fh:  # bytes, decoded line by line, so that a bad byte is reported with its line
        for lineno, raw in enumerate(fh, 1):
            line = _decode(raw, path, lineno)
            if line.strip():
                try:
                    yield f"{path}:{lineno}", json.loads(line)
                except ValueError as err:
                    raise _bad_json(path, err, lineno) from None


def _decode(raw: bytes, path: Path, first_line: int = 1) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line, column = first_line + raw.count(b"\n", 0, err.start), err.start - raw.rfind(b"\n", 0, err.start)
        raise DataFormatError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {column}); save "
                              "the file as UTF-8") from None


def _bad_json(path: Path, err: ValueError, line: int | None = None) -> DataFormatError:
    """The error for invalid JSON at `line` (default: the decoder's line in the whole text, if it knows one)."""
    if isinstance(err, json.JSONDecodeError):
        return DataFormatError(f"{path}:{line or err.lineno}: invalid JSON ({err.msg} at column {err.colno})")
    # e.g. an integer of more than 4300 digits
    return DataFormatError(f"{path}{'' if line is None else f':{line}'}: invalid JSON value ({err})")


def _iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    """One JSON value (an array of records, an object holding one list of records such as `{"data": [...]}`, or one
    record), or JSON Lines saved with a .json suffix: several values."""
    text = _decode(path.read_bytes(), path)
    if not text.strip():
        return
    try:
        obj = json.loads(text)
    except ValueError as err:
        if getattr(err, "msg", None) == "Extra data" and "\n" not in text[:err.pos].rstrip():
            yield from _iter_jsonl(path)  # a one-line first value, then more: JSON Lines
            return
        lines: list[int] = []  # a value error (e.g. a 5000-digit integer) in an array: its element's line
        if not isinstance(err, json.JSONDecodeError) and text.lstrip().startswith("["):
            with contextlib.suppress(ValueError):
                lines.extend(_element_lines(text))  # up to the element it stops at
        raise _bad_json(path, err, lines[-1] if lines else None) from None
    if isinstance(obj, list):
        yield from ((f"{path}:{line}", rec) for line, rec in zip(_element_lines(text), obj, strict=True))
        return
    if not isinstance(obj, dict):
        raise DataFormatError(f"{path}:1: expected a JSON array or object, got {type(obj).__name__}")
    lists = [obj["data"]] if isinstance(obj.get("data"), list) else [v for v in obj.values() if isinstance(v, list)]
    if len(lists) == 1:  # e.g. {"data": [...]}; line numbers are not recoverable here
        yield from ((f"{path}: record {i}", rec) for i, rec in enumerate(lists[0]))
    else:
        yield f"{path}:1", obj  # a single record


def _element_lines(text: str) -> Iterator[int]:
    """The line each element of the valid JSON array `text` starts on, so that a bad record is named by its line."""
    decoder, pos, line, counted = json.JSONDecoder(), text.index("[") + 1, 1, 0
    while (pos := _JSON_SPACE.match(text, pos).end()) < len(text) and text[pos] != "]":
        line += text.count("\n", counted, pos)  # counted on from the last element: linear in the file's size
        counted = pos
        yield line
        pos = _JSON_SPACE.match(text, decoder.raw_decode(text, pos)[1]).end() + 1  # past the "," (or the "]")


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for corrupt files
        raise DataFormatError(f"{path}: cannot read parquet file ({err})") from None
    yield from ((f"{path}: row {i}", rec) for i, rec in enumerate(table.to_pylist()))


def _load_hub(name: str, split: str, subset: str | None, keys: tuple[str, str, str]) -> list[dict[str, Any]]:
    import datasets
    from huggingface_hub import is_offline_mode

    try:
        ds = datasets.load_dataset(name, subset, split=split)
    except Exception as err:
        hint = " (HF_HUB_OFFLINE is set: only locally cached datasets load)" if is_offline_mode() else ""
        raise DataFormatError(f"cannot load hub dataset {name!r} split {split!r}{hint}: {err}") from err
    rows = [_normalize(rec, f"{name}[{split}] row {i}", keys, default_id=f"{i}") for i, rec in enumerate(ds)]
    if not rows:
        raise DataFormatError(f"{name}[{split}]: dataset is empty")
    return rows


def _normalize(record: Any, where: str, keys: tuple[str, str, str], default_id: str) -> dict[str, Any]:
    problem_key, answer_key, id_key = keys
    if not isinstance(record, dict):
        raise DataFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    dapo = problem_key not in record and isinstance(record.get("prompt"), list) \
        and isinstance(record.get("reward_model"), dict)
    problem = _dapo_problem(record["prompt"]) if dapo else record.get(problem_key)
    answer = record["reward_model"].get("ground_truth") if dapo and answer_key not in record else record.get(answer_key)
    gsm8k = GSM8K_ANSWER.search(answer) if isinstance(answer, str) else None
    if gsm8k and problem is None:  # the hub's GSM8K names its problem field `question`
        problem, problem_key = record.get("question"), "question"
    for key, value in ((problem_key, problem), (answer_key, answer)):
        if value is None and key in record:
            raise DataFormatError(f"{where}: field {key!r} is null; give it a value (or drop the row)")
        if value is None:
            present = ", ".join(sorted(record)) or "none"
            raise DataFormatError(f"{where}: missing field {key!r} (fields present: {present})")
    if not isinstance(problem, str) or not problem.strip():
        raise DataFormatError(f"{where}: field {problem_key!r} must be a non-empty string, got {problem!r}")
    answer = _answer_to_str(gsm8k.group(1) if gsm8k else answer, where, answer_key)
    rid = record.get(id_key)
    if rid is None and dapo and isinstance(record.get("extra_info"), dict):
        rid = record["extra_info"].get("index")
    dropped = {problem_key, answer_key, id_key, "prompt", "reward_model"} if dapo else {problem_key, answer_key, id_key}
    extras = {k: v for k, v in record.items() if k not in dropped and isinstance(v, str | int | float | bool)}
    if gsm8k and "solution" not in extras:
        worked = GSM8K_CALCULATOR.sub("", record[answer_key][: gsm8k.start()]).strip()
        extras["solution"] = f"{worked}\nThe final answer is \\boxed{{{answer}}}."
    return {**extras, "id": str(default_id if rid is None else rid), "problem": problem.strip(), "answer": answer}


def _answer_to_str(answer: Any, where: str, key: str) -> str:
    if isinstance(answer, bool):
        raise DataFormatError(f"{where}: field {key!r} must be a string or number, got {answer!r}")
    if isinstance(answer, float):
        if not math.isfinite(answer):
            raise DataFormatError(f"{where}: field {key!r} must be a finite number, got {answer!r}")
        if answer.is_integer():  # AMC sources store 142.0
            return str(int(answer))
        # Python's shortest repr in positional notation (1e-05 -> '0.00001'): math-verify reads '1e-05' as text, so a
        # correct \boxed{0.00001} would score 0.
        return format(Decimal(repr(answer)), "f")
    if isinstance(answer, int):  # never too long for str(): JSON and Arrow refuse such integers when reading
        return str(answer)
    if isinstance(answer, str) and answer.strip():
        return answer.strip()
    raise DataFormatError(f"{where}: field {key!r} must be a non-empty string or number, got {answer!r}")


def _dapo_problem(messages: list) -> str | None:
    users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role", "user") == "user"]
    if not users or not isinstance(users[-1], str):
        return None
    return users[-1].strip().removeprefix(DAPO_PREFIX.strip()).removesuffix(DAPO_SUFFIX.strip()).strip()
