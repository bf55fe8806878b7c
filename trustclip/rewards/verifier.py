"""Binary correctness with math-verify in persistent worker processes under a hard per-call timeout.

`score_completions` extracts each answer (`trustclip.rewards.answers`), settles what plain comparison can, and
sends the rest to math-verify (`parse` + `verify`). math-verify's own timeouts rely on `signal.alarm`, which fails
outside the main thread, so they are disabled in the worker and the parent enforces the deadline instead: a worker
that runs past it is killed and replaced. A timeout or an exception scores 0 and is counted (`reward/timeouts`,
`reward/errors`), so a pathological completion never stalls or kills training.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing.connection import wait
from pathlib import Path

from trustclip.rewards.answers import extract_answer, fast_verdict

DEFAULT_TIMEOUT = 5.0  # seconds per math-verify call (the RL reward and the evaluation both use it)
Verdict = bool | str  # True / False, or "timeout" / "error" (both score 0)


@dataclass
class RewardStats:
    """Counters since creation. `as_metrics()` gives the names the trainer logs."""

    calls: int = 0
    fast_path: int = 0
    math_verify: int = 0
    no_answer: int = 0
    timeouts: int = 0
    errors: int = 0

    def as_metrics(self) -> dict[str, float]:
        return {f"reward/{k}": float(v) for k, v in asdict(self).items()}


def _latex_arg(s: str) -> str:
    return s if "$" in s or "\\boxed" in s else f"${s}$"


def _worker_main() -> None:  # pragma: no cover - runs in the child process
    """Worker loop: one JSON request per stdin line, one JSON reply per line on the original stdout."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # line-buffered: each reply goes out with its newline
    os.dup2(2, 1)  # stray prints from sympy & co. must not corrupt the protocol

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
        print(json.dumps({"fatal": f"{type(err).__name__}: {err}"}), file=proto)
        return
    print(json.dumps({"ready": True}), file=proto)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            # Backstop: if the parent died mid-call nobody would kill a hung worker.
            signal.alarm(math.ceil(req["timeout"]) + 30)
            # raise_on_error: an exception must reach the parent to be counted, not become a silent False.
            gold = parse(_latex_arg(req["gold"]), parsing_timeout=None, raise_on_error=True)
            pred = parse(_latex_arg(req["pred"]), parsing_timeout=None, raise_on_error=True)
            ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None, raise_on_error=True)
            signal.alarm(0)
            print(json.dumps({"ok": bool(ok)}), file=proto)
        except BaseException as err:  # noqa: BLE001 - RecursionError, MemoryError, sympy errors...
            signal.alarm(0)
            print(json.dumps({"error": f"{type(err).__name__}: {str(err)[:200]}"}), file=proto)


class _Worker:
    """One math-verify process: started and ready on construction (RuntimeError otherwise), asked one pair at a
    time; a worker that overran its deadline is killed, one that crashed is reaped (`alive` is then False)."""

    def __init__(self, memory_mb: int, startup_timeout: float) -> None:
        env = dict(os.environ, TRUSTCLIP_VERIFY_MEMORY_MB=str(memory_mb), OMP_NUM_THREADS="1")
        pkg_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        # A plain subprocess (not multiprocessing): nothing from the parent's __main__ is re-imported,
        # and a new session keeps Ctrl-C in a terminal from reaching the workers.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from trustclip.rewards.verifier import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True,
        )
        try:
            reply = self._receive(startup_timeout)
        except EOFError:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)  # EOF comes just before the exit: wait for the real exit code
            self.kill()
            raise RuntimeError(f"math-verify worker exited during startup (exit code {self.proc.returncode})") from None
        if reply is None or "fatal" in reply:
            self.kill()
            raise RuntimeError(f"math-verify worker did not start within {startup_timeout:.0f} s" if reply is None
                               else f"math-verify worker failed to start: {reply['fatal']} (is math-verify installed?)")

    @property
    def alive(self) -> bool:
        # killed (stdin closed) but not yet reaped counts as dead: asking it would write to a closed pipe
        return not self.proc.stdin.closed and self.proc.poll() is None

    def ask(self, gold: str, pred: str, timeout: float) -> Verdict:
        """The verdict on one pair; raises OSError when the worker had died before the request."""
        self.proc.stdin.write((json.dumps({"gold": gold, "pred": pred, "timeout": timeout}) + "\n").encode())
        self.proc.stdin.flush()
        try:
            reply = self._receive(timeout)
        except EOFError:  # crashed (e.g. killed by the memory limit)
            self.kill()
            return "error"
        if reply is None:
            self.kill()
            return "timeout"
        return bool(reply["ok"]) if "ok" in reply else "error"

    def _receive(self, timeout: float) -> dict | None:
        """The next reply, None when `timeout` seconds pass first; EOFError when the process exits. At most one
        reply is ever pending, written in one short line, so a buffered readline once the pipe is readable neither
        blocks nor swallows a later reply."""
        if not wait([self.proc.stdout], timeout):
            return None
        line = self.proc.stdout.readline()
        if not line.endswith(b"\n"):  # the process exited
            raise EOFError
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()  # a no-op once the process has exited
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()


class MathVerifier:
    """math-verify in up to `num_workers` persistent worker processes with a hard per-call timeout.

    `equal_many(pairs, timeout)` returns one verdict per `(gold, pred)` pair: True, False, or `"timeout"` /
    `"error"` (both mean score 0; they are counted in `stats`). One thread per worker feeds it pairs; a worker
    that timed out, crashed or died while idle is replaced. Thread-safe; after a `fork` the child lazily starts
    its own workers.
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
        self._closes = 0  # a call in flight when `close` ran starts no new worker
        atexit.register(self.close)

    def equal_many(self, pairs: Sequence[tuple[str, str]], timeout: float = DEFAULT_TIMEOUT) -> list[Verdict]:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if not pairs:
            return []
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's pipes are not ours to use
                self._workers, self._pid = [], os.getpid()
            slots: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
            for i in range(self.num_workers):
                slots.put(self._workers[i] if i < len(self._workers) else None)
            closes = self._closes

            def verdict(pair: tuple[str, str]) -> Verdict:
                worker = slots.get()
                try:
                    for _ in range(2):  # a worker found dead while idle (e.g. OOM killer) is replaced, the pair retried
                        if worker is None or not worker.alive:
                            worker = self._replace(worker, closes)
                        with contextlib.suppress(OSError):
                            return worker.ask(*pair, timeout)
                    return "error"
                finally:
                    slots.put(worker)

            pool = ThreadPoolExecutor(min(self.num_workers, len(pairs)), thread_name_prefix="math-verify")
            try:
                results = list(pool.map(verdict, pairs))
            except BaseException:
                # Start-up failure or Ctrl-C mid-call: workers may hold stale tasks, so start afresh next time.
                pool.shutdown(wait=False, cancel_futures=True)
                self.close()
                raise
            pool.shutdown()
            self.stats.timeouts += results.count("timeout")
            self.stats.errors += results.count("error")
        return results

    def _replace(self, worker: _Worker | None, closes: int) -> _Worker:
        if worker is not None:
            worker.kill()
        closed = RuntimeError("the math-verify workers were closed during the call")
        if closes != self._closes:
            raise closed
        new = _Worker(self.memory_mb, self.startup_timeout)
        if closes != self._closes:
            new.kill()  # close() ran while it started (seconds): it must not outlive the pool
            raise closed
        if worker in self._workers:  # remove and append, not a new list: other threads replace theirs meanwhile
            self._workers.remove(worker)
        self._workers.append(new)
        return new

    def close(self) -> None:
        """Kill the worker processes (new ones start on the next call)."""
        if self._pid != os.getpid():
            return
        self._closes += 1
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


def score_completions(completions: Sequence[str], answers: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT,
                      fallback: bool = True, verifier: MathVerifier | None = None) -> list[float]:
    """Binary correctness (1.0 / 0.0) of each completion against its reference answer."""
    if not timeout > 0:  # checked here, not only where math-verify is called: most answers never reach it
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
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
    stats.math_verify += len(slow)
    verdicts = verifier.equal_many([(gold, pred) for _, gold, pred in slow], timeout=timeout)  # [] starts no worker
    for (i, _, _), verdict in zip(slow, verdicts, strict=True):
        scores[i] = 1.0 if verdict is True else 0.0
    return scores


def verify_answer(completion: str, answer: str, timeout: float = DEFAULT_TIMEOUT) -> float:
    """1.0 if the completion's final answer (last `\\boxed{}`, documented fallback otherwise) equals
    `answer` according to math-verify, else 0.0. Never hangs longer than about `timeout` seconds;
    timeouts and errors score 0 and are counted in `default_verifier().stats`."""
    return score_completions([completion], [answer], timeout=timeout)[0]
