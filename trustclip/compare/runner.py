"""Resumable execution of a comparison's runs: each run is one worker process (`worker.py`), `jobs` at a time, each
watched by a thread of a `concurrent.futures` pool.

- A run is *finished* when `run_complete.json` (written atomically by the worker after the pipeline returned)
  carries the run's fingerprint and `summary.json` is readable. Finished runs are never redone.
- An unfinished run directory (killed compare, crash, power cut) is continued with the trainer's resume
  (finished stages are kept, RL restarts from its last checkpoint); if that resumed run fails it is restarted
  once from scratch. `resume_partial=False` always restarts from scratch.
- A run directory made with different settings (other recipe, overrides, hyper-parameters) is an error unless
  `redo_changed=True`: results of different experiments are never mixed silently.
- Compares sharing a pool of runs (`--runs-dir`) share its runs: a run another compare is making (its lock held)
  is waited for, then reused; a compare holds a run's lock from before its directory is prepared until its worker
  has exited (the worker inherits it), so two compares never make one run at once.
- A crash of one run does not stop the others (an RL run whose shared SFT run failed fails with it). Ctrl-C or
  SIGTERM stops every worker's process group; a worker whose compare was SIGKILLed exits by itself (it watches its
  parent), so nothing is orphaned, and rerunning the same command resumes. Every start / finish / failure goes
  to `compare_log.jsonl`, and a status line with an ETA is printed every `progress_every` seconds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trustclip.compare.plan import SPEC_FILE, RunSpec
from trustclip.compare.worker import COMPLETE_FILE, LOCK_FILE, PARENT_ENV, SUMMARY_FILE
from trustclip.files import append_jsonl, read_json, read_jsonl, try_lock, write_json_atomic

LOG_FILE = "compare_log.jsonl"
WORKER_LOG = "worker.log"
COMPARE_LOCK = ".compare.lock"
KILL_GRACE = 10.0  # seconds a worker gets to exit after SIGTERM before SIGKILL
LOCK_POLL = 2.0  # seconds between looks at a run another process is making


class ChangedRunError(ValueError):
    """A run directory holds a run made with different settings."""


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def is_finished(spec: RunSpec) -> bool:
    """True when the run completed with exactly this spec's settings."""
    marker = read_json(spec.run_dir / COMPLETE_FILE)
    return (isinstance(marker, dict) and marker.get("fingerprint") == spec.fingerprint()
            and isinstance(read_json(spec.run_dir / SUMMARY_FILE), dict))


def check_runs(runs: Sequence[RunSpec]) -> None:
    """Every run's configuration as `trustclip train` checks it (`check_run`), before any run starts."""
    from trustclip.train.checks import check_run
    from trustclip.train.config import TrainConfig, from_dict

    checked: set[str] = set()
    for spec in runs:
        if spec.fingerprint() in checked:
            continue
        checked.add(spec.fingerprint())
        try:
            check_run(from_dict(TrainConfig, spec.config))
        except (ValueError, FileNotFoundError) as err:
            raise ValueError(f"run {spec.run_id}: {err}") from None


def check_changed(runs: Sequence[RunSpec], redo_changed: bool = False) -> list[RunSpec]:
    """Runs whose directory holds a spec with another fingerprint; raises ChangedRunError unless
    `redo_changed`, in which case those directories are removed (their runs will be redone)."""
    changed = [spec for spec in runs if isinstance(old := read_json(spec.run_dir / SPEC_FILE), dict)
               and old.get("fingerprint") != spec.fingerprint()]
    if changed and not redo_changed:
        names = ", ".join(s.run_id for s in changed[:5]) + (" ..." if len(changed) > 5 else "")
        raise ChangedRunError(
            f"{len(changed)} run(s) in {changed[0].root} were made with different settings ({names}); "
            "use another --output-dir, or --redo-changed to delete and redo them")
    for spec in changed:
        shutil.rmtree(spec.run_dir)
    return changed


def prepare_run_dir(spec: RunSpec, resume_partial: bool, pipeline: str | None = None) -> bool:
    """Make the run directory ready to start; returns True when the run should resume earlier progress (its
    state.json or a checkpoint is there)."""
    run_dir = spec.run_dir
    resume = resume_partial and run_dir.is_dir() and (
        (run_dir / "state.json").is_file() or any(p.is_dir() for p in run_dir.rglob("checkpoint-*")))
    if run_dir.is_dir() and not resume:
        for child in run_dir.iterdir():
            if child.name != LOCK_FILE:
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    write_json_atomic(run_dir / SPEC_FILE, {**spec.to_dict(), **({"pipeline": pipeline} if pipeline else {})})
    return resume


@dataclass
class ExecutionResult:
    """What `execute` did: run ids finished now, already finished before, failed (with reasons)."""

    finished: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    interrupted: bool = False


def acquire_compare_lock(root: Path) -> Any:
    """Exclusive lock on ROOT/.compare.lock for the compare's lifetime; raises if another compare holds it."""
    handle = try_lock(root / COMPARE_LOCK)
    if handle is None:
        holder = (root / COMPARE_LOCK).read_text().strip() or "?"
        raise RuntimeError(f"another compare (pid {holder}) is running in {root}; wait for it or stop it")
    return handle


def execute(runs: Sequence[RunSpec], root: str | Path, *, jobs: int | None = None, threads: int | None = None,
            resume_partial: bool = False, redo_changed: bool = False, pipeline: str | None = None,
            run_timeout: float | None = None, progress: Callable[[str], None] = print,
            progress_every: float = 30.0) -> ExecutionResult:
    """Run every unfinished spec, `jobs` at a time (default min(2, cores)), each in a worker process with
    `threads` torch threads (default cores // jobs). Safe to call again after any interruption."""
    root = Path(root)
    jobs = jobs or max(1, min(2, _cores()))
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    threads = threads or max(1, _cores() // jobs)  # so that parallel runs do not oversubscribe the cores
    with acquire_compare_lock(root):
        check_changed(runs, redo_changed)
        return _Execution(list(runs), root, jobs, threads, resume_partial, pipeline, run_timeout, progress,
                          progress_every).run()


@dataclass
class _Execution:
    runs: list[RunSpec]
    root: Path
    jobs: int
    threads: int
    resume_partial: bool
    pipeline: str | None
    run_timeout: float | None
    say: Callable[[str], None]
    progress_every: float
    result: ExecutionResult = field(default_factory=ExecutionResult)
    running: dict[str, tuple[RunSpec, subprocess.Popen, float]] = field(default_factory=dict)
    futures: dict[str, Future] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> ExecutionResult:
        finished = {spec.run_id for spec in self.runs if is_finished(spec)}
        todo = [spec for spec in self.runs if spec.run_id not in finished]
        self.result.skipped = [spec.run_id for spec in self.runs if spec.run_id in finished]
        self.say(f"{len(self.runs)} runs: {len(finished)} already finished, {len(todo)} to run "
                 f"({self.jobs} in parallel, {self.threads} torch thread(s) each)")
        for run_id in self.result.skipped:
            self.log("skip", run_id)
        # SFT runs are queued first, so an RL run that waits for its SFT run (in its slot) waits for a started one.
        todo.sort(key=lambda spec: spec.kind != "sft")
        handlers = self._catch_signals()
        try:
            with ThreadPoolExecutor(self.jobs, thread_name_prefix="compare-run") as pool:
                for spec in todo:
                    self.futures[spec.run_id] = pool.submit(self.run_one, spec)
                pending, last_status, terminated = set(self.futures.values()), time.time(), False
                while pending:
                    _, pending = wait(pending, timeout=0.5)
                    if self.stop.is_set() and not terminated:
                        terminated = True
                        self._terminate_all()
                    elif pending and self.running and time.time() - last_status >= self.progress_every:
                        self.say(self.status_line())
                        last_status = time.time()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        for future in self.futures.values():
            future.result()  # a bug in a run's thread surfaces here instead of vanishing
        return self.result

    # ------------------------------------------------------------------------------------------------- one run
    def run_one(self, spec: RunSpec) -> None:
        dep = spec.depends_on
        if dep is not None and dep.run_id in self.futures:
            self.futures[dep.run_id].result()
        if self.stop.is_set():
            return
        if dep is not None and not is_finished(dep):
            why = "failed" if dep.run_id in self.result.failed else "did not finish"
            return self.fail(spec, f"its SFT run {dep.run_id} {why}")
        lock = self.claim(spec)
        if lock is None:  # stopped while waiting
            return None
        with lock:  # held (and shared with its worker) until the run is done: no other compare touches it meanwhile
            if is_finished(spec):  # made meanwhile by another compare sharing the pool
                with self.lock:
                    self.result.skipped.append(spec.run_id)
                self.log("skip", spec.run_id, made_by="another process")
                return self.say(f"= {spec.run_id}: finished by another compare sharing the runs; reused")
            return self.make(spec, lock)

    def claim(self, spec: RunSpec) -> Any:
        """The run's lock; while another process (a compare sharing the pool, or its worker) holds it, wait for it
        to let go. None when this compare is stopped while waiting."""
        said = False
        while not self.stop.is_set():
            lock = try_lock(spec.run_dir / LOCK_FILE)
            if lock is not None:
                return lock
            if not said:
                said = True
                holder = _read_text(spec.run_dir / LOCK_FILE) or "?"
                self.log("wait", spec.run_id, holder=holder)
                self.say(f"~ {spec.run_id} is being made by another process (pid {holder}); waiting for it")
            self.stop.wait(LOCK_POLL)
        return None

    def make(self, spec: RunSpec, lock: Any) -> None:
        """Run the worker (holding `lock`) until the run finishes or fails; a failed resume restarts once."""
        resume = self.resume_partial
        while True:
            resumed = prepare_run_dir(spec, resume, self.pipeline)
            code, seconds, reason = self.launch(spec, resumed, lock)
            if code is None:  # stopped before it started
                return None
            if code == 0 and is_finished(spec):
                with self.lock:
                    self.result.finished.append(spec.run_id)
                    self.result.seconds[spec.run_id] = seconds
                self.log("finish", spec.run_id, seconds=seconds)
                done = len(self.result.finished) + len(self.result.skipped)
                return self.say(f"< done  {spec.run_id} in {_clock(seconds)} [{done}/{len(self.runs)}]")
            if self.stop.is_set():
                return self.log("interrupted", spec.run_id, seconds=seconds)
            tail = _tail(spec.run_dir / WORKER_LOG)
            if resumed and code != -signal.SIGKILL:
                self.log("resume_failed", spec.run_id, seconds=seconds, returncode=code, tail=tail)
                self.say(f"! resuming {spec.run_id} failed ({reason}); restarting it from scratch")
                resume = False
                continue
            return self.fail(spec, f"{reason}; log: {spec.run_dir / WORKER_LOG}", seconds=seconds, returncode=code,
                             tail=tail)

    def launch(self, spec: RunSpec, resumed: bool, lock: Any) -> tuple[int | None, float, str]:
        """Start the worker, handing it the run's lock, and wait for it: (exit code or None if stopped first,
        seconds, reason)."""
        cmd = [sys.executable, "-m", "trustclip.compare.worker", str(spec.run_dir), "--threads", str(self.threads),
               "--lock-fd", str(lock.fileno())]
        cmd += ["--resume"] if resumed else []
        env = {**os.environ, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
               **{var: str(self.threads) for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}}
        with self.lock:
            if self.stop.is_set():
                return None, 0.0, "stopped"
            with (spec.run_dir / WORKER_LOG).open("a", encoding="utf-8") as log:
                process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                           pass_fds=(lock.fileno(),))
            started = time.time()
            self.running[spec.run_id] = (spec, process, started)
        self.log("start", spec.run_id, pid=process.pid, resumed=resumed)
        self.say(f"> start {spec.run_id}" + (" (resuming from checkpoint)" if resumed else ""))
        try:
            code, reason = process.wait(timeout=self.run_timeout), ""
        except subprocess.TimeoutExpired:
            _kill(process)
            code, reason = -signal.SIGKILL, f"timed out after {time.time() - started:.0f} s (--run-timeout)"
        with self.lock:
            self.running.pop(spec.run_id, None)
        return code, time.time() - started, reason or f"worker exited with code {code}"

    def fail(self, spec: RunSpec, reason: str, **extra: Any) -> None:
        with self.lock:
            self.result.failed[spec.run_id] = reason
        self.log("fail", spec.run_id, reason=reason, **extra)
        tail = extra.get("tail")
        self.say(f"! FAILED {spec.run_id}: {reason}" + ("\n    " + tail.replace("\n", "\n    ") if tail else ""))

    # ------------------------------------------------------------------------------------------------- helpers
    def status_line(self) -> str:
        now = time.time()
        kinds = {spec.run_id: spec.kind for spec in self.runs}
        with self.lock:
            running = list(self.running.values())
            timed = [(kinds[r], t) for r, t in self.result.seconds.items()]
        done = len(self.result.finished) + len(self.result.skipped)
        parts = [f"{spec.run_id} ({_run_position(spec.run_dir)}, {_clock(now - t0)})" for spec, _, t0 in running]
        line = f"  {done}/{len(self.runs)} done, {len(self.result.failed)} failed; running: {'; '.join(parts)}"
        mean = {kind: sum(ts) / len(ts) for kind in ("sft", "rl") if (ts := [t for k, t in timed if k == kind])}
        left = [s for s in self.runs if s.run_id in self.futures and not self.futures[s.run_id].done()]
        if left and all(s.kind in mean for s in left):
            work = sum(mean[s.kind] for s in left) - sum(now - t0 for _, _, t0 in running)
            line += f"; ~{_clock(max(work, 0.0) / self.jobs)} left (projected from runs timed here)"
        return line

    def log(self, event: str, run_id: str, **extra: Any) -> None:
        with self.lock:
            append_jsonl(self.root / LOG_FILE, {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "event": event,
                                                "run": run_id, **extra})

    def _catch_signals(self) -> dict[int, Any]:
        def stop(signum: int, frame: Any) -> None:
            self.stop.set()
            self.result.interrupted = True

        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                old[sig] = signal.signal(sig, stop)
        return old

    def _terminate_all(self) -> None:
        with self.lock:
            running = [process for _, process, _ in self.running.values()]
        self.say(f"interrupted: stopping {len(running)} running run(s); rerun the same command to resume")
        for process in running:
            _kill(process)


def _kill(process: subprocess.Popen, grace: float = KILL_GRACE) -> None:
    """SIGTERM the worker's process group, SIGKILL it after `grace` seconds."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace)
    except (ProcessLookupError, PermissionError):
        pass
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def _tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(line[-300:] for line in text.replace("\r", "\n").splitlines()[-lines:])


def _run_position(run_dir: Path) -> str:
    """Where a running run is, from the files it has written so far (best effort)."""
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if isinstance(r.get("step"), int | float)]
    return f"{steps[-1].get('stage', 'rl')} step {int(steps[-1]['step'])}" if steps else "starting"
