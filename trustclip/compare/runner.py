"""Resumable execution of a comparison's runs in parallel worker processes.

- A run is *finished* when `run_complete.json` (written atomically by the worker after the pipeline
  returned) carries the run's fingerprint and `summary.json` is readable. Finished runs are never redone.
- An unfinished run directory (killed compare, crash, power cut) is continued with the trainer's resume
  (finished stages are kept, RL restarts from its last checkpoint); if that resumed run fails it is
  restarted once from scratch. `resume_partial=False` always restarts from scratch.
- A run directory made with different settings (other recipe, overrides, hyper-parameters) is an error
  unless `redo_changed=True`: results of different experiments are never mixed silently.
- Each run is one `python -m trustclip.compare.worker` process with its own torch thread budget, so a
  crash of one run does not stop the others. Every start/finish/failure goes to `compare_log.jsonl`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trustclip.compare.plan import SPEC_FILE, RunSpec
from trustclip.compare.worker import COMPLETE_FILE, LOCK_FILE, PARENT_ENV, SUMMARY_FILE
from trustclip.files import append_jsonl, read_json, read_jsonl, try_lock, write_json_atomic

LOG_FILE = "compare_log.jsonl"
WORKER_LOG = "worker.log"
COMPARE_LOCK = ".compare.lock"


class ChangedRunError(ValueError):
    """A run directory holds a run made with different settings."""


def default_jobs() -> int:
    """min(2, usable cores)."""
    return max(1, min(2, _cores()))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_threads(jobs: int) -> int:
    """Torch threads per run so that `jobs` parallel runs do not oversubscribe the cores."""
    return max(1, _cores() // max(1, jobs))


def is_finished(spec: RunSpec) -> bool:
    """True when the run completed with exactly this spec's settings."""
    marker = read_json(spec.run_dir / COMPLETE_FILE)
    return (isinstance(marker, dict) and marker.get("fingerprint") == spec.fingerprint()
            and isinstance(read_json(spec.run_dir / SUMMARY_FILE), dict))


def _has_progress(run_dir: Path) -> bool:
    """The pipeline got far enough to leave something to resume (its state.json or a checkpoint)."""
    return (run_dir / "state.json").is_file() or any(p.is_dir() for p in run_dir.rglob("checkpoint-*"))


def check_changed(runs: Sequence[RunSpec], redo_changed: bool = False) -> list[RunSpec]:
    """Runs whose directory holds a spec with another fingerprint; raises ChangedRunError unless
    `redo_changed`, in which case those directories are removed (their runs will be redone)."""
    changed = []
    for spec in runs:
        old = read_json(spec.run_dir / SPEC_FILE)
        if isinstance(old, dict) and old.get("fingerprint") != spec.fingerprint():
            changed.append(spec)
    if changed and not redo_changed:
        names = ", ".join(s.run_id for s in changed[:5]) + (" ..." if len(changed) > 5 else "")
        raise ChangedRunError(
            f"{len(changed)} run(s) in {changed[0].root} were made with different settings ({names}); "
            "use another --output-dir, or --redo-changed to delete and redo them")
    for spec in changed:
        shutil.rmtree(spec.run_dir)
    return changed


def prepare_run_dir(spec: RunSpec, resume_partial: bool, pipeline: str | None = None) -> bool:
    """Make the run directory ready to start; returns True when the run should resume earlier progress."""
    run_dir = spec.run_dir
    resume = resume_partial and run_dir.is_dir() and _has_progress(run_dir)
    if run_dir.is_dir() and not resume:
        for child in run_dir.iterdir():
            if child.name == LOCK_FILE:
                continue
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    payload = spec.to_dict()
    if pipeline:
        payload["pipeline"] = pipeline
    write_json_atomic(run_dir / SPEC_FILE, payload)
    return resume


@dataclass
class Running:
    spec: RunSpec
    process: subprocess.Popen
    started: float
    resumed: bool
    log_handle: Any


@dataclass
class ExecutionResult:
    """What `execute` did: run ids finished now, already finished before, failed (with reasons)."""

    finished: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not self.failed and not self.interrupted


class Executor:
    """Runs specs with at most `jobs` worker processes at once; see `execute`."""

    def __init__(self, runs: Sequence[RunSpec], root: Path, jobs: int, threads: int, *, resume_partial: bool,
                 pipeline: str | None, run_timeout: float | None, progress: Callable[[str], None],
                 progress_every: float):
        self.runs, self.root, self.jobs, self.threads = list(runs), root, jobs, threads
        self.resume_partial, self.pipeline, self.run_timeout = resume_partial, pipeline, run_timeout
        self.say, self.progress_every = progress, progress_every
        self.result = ExecutionResult()
        self.running: list[Running] = []
        self.pending: list[RunSpec] = []
        self._kind = {spec.run_id: spec.kind for spec in self.runs}
        self.fresh_only: set[str] = set()  # runs whose resume failed: restart from scratch
        self._stop = False

    # -------------------------------------------------------------------------------------------- lifecycle
    def execute(self) -> ExecutionResult:
        pending = self.pending
        for spec in self.runs:
            if is_finished(spec):
                self.result.skipped.append(spec.run_id)
            else:
                pending.append(spec)
        self.say(f"{len(self.runs)} runs: {len(self.result.skipped)} already finished, {len(pending)} to run "
                 f"({self.jobs} in parallel, {self.threads} torch thread(s) each)")
        for run_id in self.result.skipped:
            self._log("skip", run_id)
        handlers = self._install_signal_handlers()
        try:
            self._loop(pending)
        finally:
            self._restore(handlers)
            if self._stop:
                self._terminate_all()
        return self.result

    def _next(self) -> RunSpec | None:
        """First pending run whose SFT run (if any) has finished, shared SFT runs first (so that no slot waits
        for one later); runs whose SFT run failed fail too."""
        for spec in sorted(self.pending, key=lambda s: s.kind != "sft"):
            dep = spec.depends_on
            if dep is not None and dep.run_id in self.result.failed:
                self.pending.remove(spec)
                self.result.failed[spec.run_id] = f"its SFT run {dep.run_id} failed"
                self._log("fail", spec.run_id, reason=self.result.failed[spec.run_id])
                continue
            if dep is None or is_finished(dep):
                self.pending.remove(spec)
                return spec
        return None

    def _loop(self, pending: list[RunSpec]) -> None:
        last_report = time.time()
        while (pending or self.running) and not self._stop:
            self._reap()
            while pending and len(self.running) < self.jobs and not self._stop:
                spec = self._next()
                if spec is None:
                    break
                self._start(spec)
            if not self.running and pending and self._next_blocked():
                break
            time.sleep(0.2)
            if time.time() - last_report >= self.progress_every and self.running:
                self.say(self._status_line())
                last_report = time.time()

    def _next_blocked(self) -> bool:
        """Nothing runs and no pending run can start (its SFT run is neither finished nor pending)."""
        waiting = {s.depends_on.run_id for s in self.pending if s.depends_on is not None}
        if waiting & {s.run_id for s in self.pending}:
            return False
        for spec in self.pending:
            dep = spec.depends_on.run_id if spec.depends_on is not None else "?"
            self.result.failed[spec.run_id] = f"could not start: its SFT run {dep} did not finish"
        self.pending.clear()
        return True

    # --------------------------------------------------------------------------------------------- one run
    def _start(self, spec: RunSpec) -> None:
        lock = try_lock(spec.run_dir / LOCK_FILE)
        if lock is None:
            self.result.failed[spec.run_id] = "locked by another live process (another compare running?)"
            self.say(f"! {spec.run_id}: {self.result.failed[spec.run_id]}")
            return
        lock.close()  # free it for the worker; the compare lock keeps other compares out meanwhile
        resume = self.resume_partial and spec.run_id not in self.fresh_only
        resumed = prepare_run_dir(spec, resume, self.pipeline)
        cmd = [sys.executable, "-m", "trustclip.compare.worker", str(spec.run_dir), "--threads", str(self.threads)]
        if resumed:
            cmd.append("--resume")
        env = {**os.environ, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(self.threads)
        handle = (spec.run_dir / WORKER_LOG).open("a", encoding="utf-8")
        process = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.running.append(Running(spec, process, time.time(), resumed, handle))
        self._log("start", spec.run_id, pid=process.pid, resumed=resumed)
        self.say(f"> start {spec.run_id}" + (" (resuming from checkpoint)" if resumed else ""))

    def _reap(self) -> None:
        for job in list(self.running):
            code = job.process.poll()
            elapsed = time.time() - job.started
            if code is None and self.run_timeout and elapsed > self.run_timeout:
                self._kill(job.process)
                code = -9
                reason = f"timed out after {elapsed:.0f} s (--run-timeout)"
            elif code is None:
                continue
            else:
                reason = f"worker exited with code {code}"
            job.log_handle.close()
            self.running.remove(job)
            self._finish(job, code, elapsed, reason)

    def _finish(self, job: Running, code: int, elapsed: float, reason: str) -> None:
        run_id = job.spec.run_id
        if code == 0 and is_finished(job.spec):
            self.result.finished.append(run_id)
            self.result.seconds[run_id] = elapsed
            self._log("finish", run_id, seconds=elapsed)
            self.say(f"< done  {run_id} in {_clock(elapsed)} "
                     f"[{len(self.result.finished) + len(self.result.skipped)}/{len(self.runs)}]")
            return
        tail = _tail(job.spec.run_dir / WORKER_LOG)
        if job.resumed and not self._stop and code not in (-9, None):
            self.fresh_only.add(run_id)
            self.pending.insert(0, job.spec)
            self._log("resume_failed", run_id, seconds=elapsed, returncode=code, tail=tail)
            self.say(f"! resuming {run_id} failed ({reason}); restarting it from scratch")
            return
        self.result.failed[run_id] = f"{reason}; log: {job.spec.run_dir / WORKER_LOG}"
        self._log("fail", run_id, seconds=elapsed, returncode=code, tail=tail)
        self.say(f"! FAILED {run_id} after {_clock(elapsed)}: {reason}\n    " + tail.replace("\n", "\n    "))

    # ---------------------------------------------------------------------------------------------- helpers
    def _status_line(self) -> str:
        done = len(self.result.finished) + len(self.result.skipped)
        parts = [f"{j.spec.run_id} ({_run_position(j.spec.run_dir)}, {_clock(time.time() - j.started)})"
                 for j in self.running]
        line = f"  {done}/{len(self.runs)} done, {len(self.result.failed)} failed; running: {'; '.join(parts)}"
        timed = {kind: [t for r, t in self.result.seconds.items() if self._kind[r] == kind] for kind in ("sft", "rl")}
        mean = {kind: sum(ts) / len(ts) for kind, ts in timed.items() if ts}
        left_specs = [*self.pending, *(j.spec for j in self.running)]
        if all(s.kind in mean for s in left_specs):
            work = sum(mean[s.kind] for s in left_specs) - sum(time.time() - j.started for j in self.running)
            line += f"; ~{_clock(max(work, 0.0) / self.jobs)} left (projected from runs timed here)"
        return line

    def _log(self, event: str, run_id: str, **extra: Any) -> None:
        append_jsonl(self.root / LOG_FILE, {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "event": event,
                                            "run": run_id, **extra})

    def _install_signal_handlers(self) -> dict[int, Any]:
        def stop(signum: int, frame: Any) -> None:
            self._stop = True
            self.result.interrupted = True

        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                old[sig] = signal.signal(sig, stop)
        return old

    @staticmethod
    def _restore(handlers: dict[int, Any]) -> None:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

    def _terminate_all(self) -> None:
        self.say(f"interrupted: stopping {len(self.running)} running run(s); rerun the same command to resume")
        for job in self.running:
            self._kill(job.process)
            job.log_handle.close()
            self._log("interrupted", job.spec.run_id, seconds=time.time() - job.started)
        self.running.clear()

    @staticmethod
    def _kill(process: subprocess.Popen, grace: float = 10.0) -> None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=grace)
        except (ProcessLookupError, PermissionError):
            pass
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


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
    rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    steps = [r for r in rows if isinstance(r.get("step"), int | float)]
    if steps:
        last = steps[-1]
        stage = last.get("stage", "rl")
        return f"{stage} step {int(last['step'])}"
    return "starting"


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
    jobs = jobs or default_jobs()
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    threads = threads or default_threads(jobs)
    with acquire_compare_lock(root):
        check_changed(runs, redo_changed)
        executor = Executor(runs, root, jobs, threads, resume_partial=resume_partial, pipeline=pipeline,
                            run_timeout=run_timeout, progress=progress, progress_every=progress_every)
        return executor.execute()
