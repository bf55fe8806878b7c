"""Verified rewards: binary correctness of the final answer (+1 correct, 0 otherwise), checked with
math-verify, plus an optional format reward.

How a completion is scored (`score_completions`, `verify_answer`, `CorrectnessReward`):

1. Extract the predicted answer (`extract_answer`): the content of the **last** `\\boxed{...}` (or
   `\\fbox{...}`). Fallback when there is none: the last `Answer: ...` line (DAPO's format), then the
   last number in the text. No extractable answer (e.g. an empty completion) scores 0.
2. Fast path, no math-verify: after light normalisation (`$`, spaces, `\\dfrac`->`\\frac`, thousands
   commas like `1,450,000`, leading zeros like `025`) equal strings or equal numbers score 1, and two
   *different integers* score 0.
3. Everything else goes to math-verify (`parse` + `verify`) in a worker process with a hard per-call
   timeout. math-verify's own timeouts rely on `signal.alarm`, which fails outside the main thread, so
   they are disabled in the worker and the parent enforces the deadline instead: a worker that runs past
   it is killed and replaced. A timeout or an exception scores 0 and is counted
   (`reward/timeouts`, `reward/errors`), so a pathological completion never stalls or kills training.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_LINE_RE = re.compile(r"(?im)^\s*\**\s*(?:final\s+)?answer\s*\**\s*[:：]\s*(.+?)\s*$")
_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_THOUSANDS_RE = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL_RE = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)$")
_SLASH_FRAC_RE = re.compile(r"^([+-]?\d+)/(\d+)$")
# \frac{12}{5}, \frac34 (unbraced arguments are single digits in LaTeX)
_LATEX_FRAC_RE = re.compile(r"^([+-]?)\\frac(?:\{([+-]?\d+)\}|(\d))(?:\{(\d+)\}|(\d))$")
DEFAULT_TIMEOUT = 5.0  # seconds per math-verify call (the RL reward and the evaluation both use it)


# --------------------------------------------------------------------------- answer extraction


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (braces matched), or None if there is none.

    `\\boxed 5` (no braces) gives `5`. An unclosed last box is skipped in favour of an earlier one.
    """
    for match in reversed(list(_BOX_RE.finditer(text))):
        start = match.end()
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return text[start + 1 : i].strip()
            continue  # unclosed
        token = re.match(r"[^\s$]+", text[start:])
        if token:
            return token.group(0).rstrip(".")
    return None


def extract_answer(text: str, fallback: bool = True) -> str | None:
    """Predicted final answer: last boxed content; else (with `fallback`) the last `Answer:` line, else
    the last number. Returns None when nothing can be extracted."""
    if not text or not text.strip():
        return None
    boxed = last_boxed(text)
    if boxed is not None or not fallback:
        return boxed or None
    lines = _ANSWER_LINE_RE.findall(text)
    if lines:
        return lines[-1].strip().rstrip(".").strip().strip("$").strip() or None
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def _normalize(ans: str) -> str:
    s = ans.strip().strip("$").strip()
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\(?:left|right)\b|\\[,;:! ]|\s+", "", s)
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
    return s.rstrip(".")


def _as_number(s: str) -> Fraction | None:
    """The exact value of a plain number, or None (not a plain number, or too long to convert: Python refuses
    integer strings of more than sys.get_int_max_str_digits() digits; math-verify then decides)."""
    try:
        return _parse_number(s)
    except ValueError:
        return None


def _parse_number(s: str) -> Fraction | None:
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    if _DECIMAL_RE.match(s):
        return Fraction(s)
    m = _SLASH_FRAC_RE.match(s)
    if m:
        sign, num, den = "", *m.groups()
    elif m := _LATEX_FRAC_RE.match(s):
        sign, num, den = m.group(1), m.group(2) or m.group(3), m.group(4) or m.group(5)
    else:
        return None
    if int(den) == 0:
        return None
    return Fraction(int(num), int(den)) * (-1 if sign == "-" else 1)


def fast_verdict(pred: str, answer: str) -> float | None:
    """1.0 / 0.0 when plain comparison decides, None when math-verify is needed."""
    p, a = _normalize(pred), _normalize(answer)
    if p == a and p:
        return 1.0
    pn, an = _as_number(p), _as_number(a)
    if pn is None or an is None:
        return None
    if pn == an:
        return 1.0
    # Two different integers are certainly different; non-integers may still match after
    # math-verify's rounding (e.g. 0.333333 vs 1/3), so they go on.
    return 0.0 if pn.denominator == 1 and an.denominator == 1 else None


# --------------------------------------------------------------------------- worker processes


@dataclass
class RewardStats:
    """Counters since creation. `as_metrics()` gives the names the trainer logs."""

    calls: int = 0
    fast_path: int = 0
    math_verify: int = 0
    no_answer: int = 0
    timeouts: int = 0
    errors: int = 0

    def as_metrics(self, prefix: str = "reward/") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in asdict(self).items()}


def _latex_arg(s: str) -> str:
    return s if "$" in s or "\\boxed" in s else f"${s}$"


def _worker_main() -> None:  # pragma: no cover - runs in the child process
    """Worker loop: one JSON request per stdin line, one JSON reply per line on the original stdout."""
    import logging
    import signal

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from sympy & co. must not corrupt the protocol

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")

    try:
        limit_mb = int(os.environ.get("TRUSTCLIP_VERIFY_MEMORY_MB", "0"))
        if limit_mb > 0:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (limit_mb << 20, limit_mb << 20))
        from math_verify import parse, verify

        for name in ("math_verify", "latex2sympy2_extended"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        verify(parse("$1$", parsing_timeout=None), parse("$1$", parsing_timeout=None), timeout_seconds=None)
    except BaseException as err:  # noqa: BLE001 - report any startup failure to the parent
        reply({"fatal": f"{type(err).__name__}: {err}"})
        return
    reply({"ready": True})
    for line in sys.stdin:
        try:
            req = json.loads(line)
            # Backstop: if the parent died mid-call nobody would kill a hung worker.
            signal.alarm(int(math.ceil(req.get("timeout", DEFAULT_TIMEOUT))) + 30)
            # raise_on_error: an exception must reach the parent to be counted, not become a silent False.
            gold = parse(_latex_arg(req["gold"]), parsing_timeout=None, raise_on_error=True)
            pred = parse(_latex_arg(req["pred"]), parsing_timeout=None, raise_on_error=True)
            ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None, raise_on_error=True)
            signal.alarm(0)
            reply({"ok": bool(ok)})
        except BaseException as err:  # noqa: BLE001 - RecursionError, MemoryError, sympy errors...
            signal.alarm(0)
            reply({"error": f"{type(err).__name__}: {str(err)[:200]}"})


class _Worker:
    def __init__(self, memory_mb: int) -> None:
        env = dict(os.environ, TRUSTCLIP_VERIFY_MEMORY_MB=str(memory_mb), OMP_NUM_THREADS="1")
        pkg_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        # A plain subprocess (not multiprocessing): nothing from the parent's __main__ is re-imported,
        # and a new session keeps Ctrl-C in a terminal from reaching the workers.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from trustclip.rewards import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self.fd = self.proc.stdout.fileno()
        self.buffer = b""
        self.state = "starting"
        self.task: int | None = None
        self.deadline = 0.0

    def send(self, payload: dict) -> None:
        self.proc.stdin.write((json.dumps(payload) + "\n").encode())
        self.proc.stdin.flush()

    def read_messages(self) -> list[dict] | None:
        """Complete messages available now; None on EOF (the process died)."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()


class MathVerifier:
    """math-verify in `num_workers` persistent worker processes with a hard per-call timeout.

    `equal_many(pairs, timeout)` returns one verdict per `(gold, pred)` pair: True, False, or
    `"timeout"` / `"error"` (both mean score 0; they are counted in `stats`). Thread-safe; after a
    `fork` the child lazily starts its own workers.
    """

    def __init__(self, num_workers: int = 1, startup_timeout: float = 120.0, memory_mb: int = 4096) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.startup_timeout = startup_timeout
        self.memory_mb = memory_mb
        self.stats = RewardStats()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._pid = os.getpid()
        atexit.register(self.close)

    def _spawn(self) -> _Worker:
        worker = _Worker(self.memory_mb)
        worker.deadline = time.monotonic() + self.startup_timeout
        return worker

    def _ensure_workers(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's pipes are not ours to use
            self._workers, self._pid = [], os.getpid()
        while len(self._workers) < self.num_workers:
            self._workers.append(self._spawn())

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = self._spawn()

    def equal_many(self, pairs: Sequence[tuple[str, str]], timeout: float = DEFAULT_TIMEOUT) -> list[bool | str]:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        results: list[bool | str] = ["error"] * len(pairs)
        if not pairs:
            return results
        with self._lock:
            self._ensure_workers()
            try:
                self._run(pairs, timeout, results)
            except BaseException:
                # Start-up failure or Ctrl-C mid-call: workers may hold stale tasks, so start afresh next time.
                self.close()
                raise
        return results

    def _run(self, pairs: Sequence[tuple[str, str]], timeout: float, results: list[bool | str]) -> None:
        pending = deque(range(len(pairs)))
        remaining = len(pairs)
        with selectors.DefaultSelector() as sel:
            while remaining:
                now = time.monotonic()
                for w in self._workers:
                    if w.state == "idle" and pending and w.proc.poll() is not None:
                        self._replace(w)  # died while idle (e.g. OOM killer): no task is lost
                    elif w.state == "idle" and pending:
                        w.task, w.state, w.deadline = pending.popleft(), "busy", now + timeout
                        gold, pred = pairs[w.task]
                        try:
                            w.send({"gold": gold, "pred": pred, "timeout": timeout})
                        except OSError:  # died while idle: retry the task on a fresh worker
                            pending.appendleft(w.task)
                            self._replace(w)
                active = [w for w in self._workers if w.state in ("starting", "busy")]
                wait = max(0.0, min(w.deadline for w in active) - time.monotonic())
                for w in active:
                    sel.register(w.fd, selectors.EVENT_READ, w)
                events = sel.select(wait)
                for w in active:
                    sel.unregister(w.fd)
                for key, _ in events:
                    remaining -= self._on_readable(key.data, results)
                now = time.monotonic()
                for w in [w for w in self._workers if w.state in ("starting", "busy") and w.deadline <= now]:
                    if w.state == "starting":
                        w.kill()
                        raise RuntimeError(f"math-verify worker did not start within {self.startup_timeout:.0f} s")
                    results[w.task] = "timeout"
                    self.stats.timeouts += 1
                    remaining -= 1
                    self._replace(w)

    def _on_readable(self, w: _Worker, results: list[bool | str]) -> int:
        """Handle a worker's output; returns how many tasks finished."""
        messages = w.read_messages()
        if messages is None:  # crashed (e.g. killed by the memory limit)
            if w.state == "starting":
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.proc.wait(timeout=5)  # EOF comes just before the exit: wait for the real exit code
                w.kill()
                code = w.proc.returncode
                raise RuntimeError(f"math-verify worker exited during startup (exit code {code})")
            done = 0
            if w.state == "busy":
                results[w.task] = "error"
                self.stats.errors += 1
                done = 1
            self._replace(w)
            return done
        done = 0
        for msg in messages:
            if "fatal" in msg:
                w.kill()
                raise RuntimeError(f"math-verify worker failed to start: {msg['fatal']} (is math-verify installed?)")
            if "ready" in msg:
                w.state = "idle"
            elif w.state == "busy":
                if "ok" in msg:
                    results[w.task] = bool(msg["ok"])
                else:
                    results[w.task] = "error"
                    self.stats.errors += 1
                w.state, w.task, done = "idle", None, done + 1
        return done

    def close(self) -> None:
        """Kill the worker processes (new ones start on the next call)."""
        if self._pid != os.getpid():
            return
        for w in self._workers:
            w.kill()
        self._workers = []


_DEFAULT_VERIFIER: MathVerifier | None = None
_DEFAULT_LOCK = threading.Lock()


def default_verifier() -> MathVerifier:
    """Process-wide verifier shared by `verify_answer` and reward functions created without one."""
    global _DEFAULT_VERIFIER
    with _DEFAULT_LOCK:
        if _DEFAULT_VERIFIER is None:
            workers = int(os.environ.get("TRUSTCLIP_VERIFY_WORKERS", "0")) or min(2, os.cpu_count() or 1)
            _DEFAULT_VERIFIER = MathVerifier(num_workers=workers)
        return _DEFAULT_VERIFIER


# --------------------------------------------------------------------------- scoring API


def score_completions(
    completions: Sequence[str],
    answers: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    fallback: bool = True,
    verifier: MathVerifier | None = None,
) -> list[float]:
    """Binary correctness (1.0 / 0.0) of each completion against its reference answer."""
    if len(completions) != len(answers):
        raise ValueError(f"got {len(completions)} completions but {len(answers)} answers")
    verifier = verifier or default_verifier()
    stats = verifier.stats
    scores = [0.0] * len(completions)
    slow: list[tuple[int, str, str]] = []
    for i, (text, answer) in enumerate(zip(completions, answers, strict=True)):
        stats.calls += 1
        try:
            pred = extract_answer(text or "", fallback=fallback)
            if pred is None:
                stats.no_answer += 1
                continue
            gold = str(answer)
            verdict = fast_verdict(pred, gold)
        except Exception:  # noqa: BLE001 - any pathological completion or answer scores 0 and is counted
            stats.errors += 1
            continue
        if verdict is not None:
            stats.fast_path += 1
            scores[i] = verdict
        else:
            slow.append((i, gold, pred))
    if slow:
        stats.math_verify += len(slow)
        verdicts = verifier.equal_many([(gold, pred) for _, gold, pred in slow], timeout=timeout)
        for (i, _, _), verdict in zip(slow, verdicts, strict=True):
            scores[i] = 1.0 if verdict is True else 0.0
    return scores


def verify_answer(completion: str, answer: str, timeout: float = DEFAULT_TIMEOUT) -> float:
    """1.0 if the completion's final answer (last `\\boxed{}`, documented fallback otherwise) equals
    `answer` according to math-verify, else 0.0. Never hangs longer than about `timeout` seconds;
    timeouts and errors score 0 and are counted in `reward_stats()`."""
    return score_completions([completion], [answer], timeout=timeout)[0]


def reward_stats() -> dict[str, float]:
    """Counters of the process-wide verifier, as `reward/<name>` metrics."""
    return default_verifier().stats.as_metrics()


def completion_text(completion: Any) -> str:
    """Text of a TRL completion: a string, or a list of chat messages (the assistant turns joined)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    if isinstance(completion, Sequence):
        return "".join(completion_text(m) for m in completion)
    raise TypeError(f"unsupported completion type {type(completion).__name__}")


class CorrectnessReward:
    """TRL reward function: `reward(completions, **columns) -> list[float]`, 1.0 correct / 0.0 not.

    The reference answer comes from the dataset column `answer_key`. `metrics()` returns this reward's
    counters (`reward/timeouts`, `reward/errors`, ...) for the trainer to log.
    """

    def __init__(
        self,
        answer_key: str = "answer",
        timeout: float = DEFAULT_TIMEOUT,
        fallback: bool = True,
        verifier: MathVerifier | None = None,
        name: str = "correctness",
    ) -> None:
        self.answer_key = answer_key
        self.timeout = timeout
        self.fallback = fallback
        self.verifier = verifier
        self.__name__ = name  # TRL names logged reward columns after `__name__`

    def __call__(self, completions: Sequence[Any], **columns: Any) -> list[float]:
        if self.answer_key not in columns:
            raise KeyError(f"reward needs the dataset column {self.answer_key!r}; got columns {sorted(columns)}")
        texts = [completion_text(c) for c in completions]
        return score_completions(
            texts, columns[self.answer_key], timeout=self.timeout, fallback=self.fallback, verifier=self._v()
        )

    def _v(self) -> MathVerifier:
        return self.verifier or default_verifier()

    def metrics(self) -> dict[str, float]:
        return self._v().stats.as_metrics()


def format_reward(completions: Sequence[Any], **columns: Any) -> list[float]:
    """Optional format reward (TRL signature): 1.0 if the completion has a non-empty `\\boxed{}` answer."""
    return [1.0 if last_boxed(completion_text(c)) else 0.0 for c in completions]
