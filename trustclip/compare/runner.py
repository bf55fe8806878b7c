"""Running a comparison's runs: each run is one worker process (`python -m trustclip.compare.runner RUN_DIR`, which
runs the pipeline on the spec's config with output_dir = RUN_DIR and RL from the shared SFT model, as `trustclip
train [--resume]` would), `jobs` at a time in a `concurrent.futures` pool.

- A run is *finished* when `run_complete.json` (written by the worker after the pipeline returned) carries the
  run's fingerprint and `summary.json` is readable. Finished runs are never redone; an unfinished one is continued
  with the trainer's resume (finished stages kept, RL from its last checkpoint), or restarted with
  `resume_partial=False`. A directory made with other settings is an error unless `redo_changed`.
- Compares sharing a pool (`--runs-dir`) share its runs: a run's lock (`RUN_DIR/.lock`) is held by the compare from
  before its directory is prepared until its worker has exited (the worker inherits it); a run another compare is
  making is waited for, then reused.
- A failed run does not stop the others. Ctrl-C / SIGTERM stops every worker's process group; a worker whose
  compare was SIGKILLed exits by itself (it watches its parent). Every start / finish / failure goes to
  `compare_log.jsonl`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
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
from trustclip.files import append_jsonl, read_json, read_jsonl, try_lock, write_json_atomic

LOG_FILE, WORKER_LOG, COMPARE_LOCK = "compare_log.jsonl", "worker.log", ".compare.lock"
COMPLETE_FILE, SUMMARY_FILE, LOCK_FILE = "run_complete.json", "summary.json", ".lock"
PARENT_ENV = "TRUSTCLIP_COMPARE_PARENT"
DEFAULT_PIPELINE = "trustclip.train.pipeline:run_pipeline"
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

    for spec in {spec.fingerprint(): spec for spec in runs}.values():
        try:
            check_run(from_dict(TrainConfig, spec.config))
        except (ValueError, FileNotFoundError) as err:
            raise ValueError(f"run {spec.run_id}: {err}") from None


def check_changed(runs: Sequence[RunSpec], redo_changed: bool = False) -> list[RunSpec]:
    """Runs whose directory holds a spec with another fingerprint; raises ChangedRunError unless `redo_changed`, in
    which case those directories are removed (their runs will be redone)."""
    changed = [spec for spec in runs if isinstance(old := read_json(spec.run_dir / SPEC_FILE), dict)
               and old.get("fingerprint") != spec.fingerprint()]
    if changed and not redo_changed:
        names = ", ".join(s.run_id for s in changed[:5]) + (" ..." if len(changed) > 5 else "")
        raise ChangedRunError(f"{len(changed)} run(s) in {changed[0].root} were made with different settings "
                              f"({names}); use another --output-dir, or --redo-changed to delete and redo them")
    for spec in changed:
        shutil.rmtree(spec.run_dir)
    return changed


def prepare_run_dir(spec: RunSpec, resume_partial: bool, pipeline: str | None = None) -> bool:
    """Make the run directory ready to start; True when the run resumes earlier progress (state.json or a
    checkpoint is there)."""
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
    """Run every unfinished spec, `jobs` at a time (default min(2, cores)), each in a worker process with `threads`
    torch threads (default cores // jobs, so that parallel runs do not oversubscribe the cores). Safe to call again
    after any interruption."""
    for name, value in (("jobs", jobs), ("threads", threads), ("run_timeout", run_timeout)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    root, jobs = Path(root), jobs or max(1, min(2, _cores()))
    with acquire_compare_lock(root):
        check_changed(runs, redo_changed)
        return _Pool(list(runs), root, jobs, threads or max(1, _cores() // jobs), resume_partial, pipeline,
                     run_timeout, progress).run(progress_every)


@dataclass
class _Pool:
    runs: list[RunSpec]
    root: Path
    jobs: int
    threads: int
    resume_partial: bool
    pipeline: str | None
    run_timeout: float | None
    say: Callable[[str], None]
    result: ExecutionResult = field(default_factory=ExecutionResult)
    running: dict[str, tuple[subprocess.Popen, float]] = field(default_factory=dict)
    futures: dict[str, Future] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, progress_every: float) -> ExecutionResult:
        self.result.skipped = [spec.run_id for spec in self.runs if is_finished(spec)]
        todo = [spec for spec in self.runs if spec.run_id not in self.result.skipped]
        self.say(f"{len(self.runs)} runs: {len(self.result.skipped)} already finished, {len(todo)} to run "
                 f"({self.jobs} in parallel, {self.threads} torch thread(s) each)")
        for run_id in self.result.skipped:
            self.log("skip", run_id)
        old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        with contextlib.suppress(ValueError):  # not the main thread: no handlers
            for sig in old:
                signal.signal(sig, lambda *_: self.stop.set())
        try:  # SFT runs first, so that an RL run waiting (in its slot) for its SFT run waits for a started one
            with ThreadPoolExecutor(self.jobs, thread_name_prefix="compare-run") as pool:
                for spec in sorted(todo, key=lambda spec: spec.kind != "sft"):  # a run's SFT run is known first
                    self.futures[spec.run_id] = pool.submit(self.run_one, spec)
                pending, last = set(self.futures.values()), time.time()
                while pending:
                    _, pending = wait(pending, timeout=0.5)
                    if self.stop.is_set() and not self.result.interrupted:
                        self.result.interrupted = True
                        with self.lock:  # a worker being started (under the lock) is in `running` once we see it
                            processes = [process for process, _ in self.running.values()]
                        self.say(f"interrupted: stopping {len(processes)} running run(s); rerun the same command "
                                 "to resume")
                        for process in processes:
                            _kill(process)
                    elif pending and self.running and time.time() - last >= progress_every:
                        self.say(self.status_line())
                        last = time.time()
        finally:
            with contextlib.suppress(ValueError):
                for sig, handler in old.items():
                    signal.signal(sig, handler)
        for future in self.futures.values():
            future.result()  # a bug in a run's thread surfaces here instead of vanishing
        return self.result

    def run_one(self, spec: RunSpec) -> None:
        dep = spec.depends_on
        if dep is not None and dep.run_id in self.futures:
            self.futures[dep.run_id].result()
        if self.stop.is_set():
            return None
        if dep is not None and not is_finished(dep):
            return self.fail(spec, f"its SFT run {dep.run_id} "
                                   f"{'failed' if dep.run_id in self.result.failed else 'did not finish'}")
        said = False
        while (lock := try_lock(spec.run_dir / LOCK_FILE)) is None:  # another compare of the pool is making it
            if not said:
                said, holder = True, _read(spec.run_dir / LOCK_FILE) or "?"
                self.log("wait", spec.run_id, holder=holder)
                self.say(f"~ {spec.run_id} is being made by another process (pid {holder}); waiting for it")
            if self.stop.wait(LOCK_POLL):
                return None
        with lock:  # held (and shared with its worker) until the run is done
            if is_finished(spec):
                with self.lock:
                    self.result.skipped.append(spec.run_id)
                self.log("skip", spec.run_id, made_by="another process")
                return self.say(f"= {spec.run_id}: finished by another compare sharing the runs; reused")
            return self.make(spec, lock)

    def make(self, spec: RunSpec, lock: Any) -> None:
        """Run the worker (handing it the run's lock) until it exits; a failed run is logged with its log's tail."""
        resumed = prepare_run_dir(spec, self.resume_partial, self.pipeline)
        cmd = [sys.executable, "-m", "trustclip.compare.runner", str(spec.run_dir), "--threads", str(self.threads),
               "--lock-fd", str(lock.fileno()), *(["--resume"] if resumed else [])]
        env = {**os.environ, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
               **dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"), str(self.threads))}
        with self.lock:
            if self.stop.is_set():
                return None
            with (spec.run_dir / WORKER_LOG).open("a", encoding="utf-8") as log:
                process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                           pass_fds=(lock.fileno(),))
            started = time.time()
            self.running[spec.run_id] = (process, started)
        self.log("start", spec.run_id, pid=process.pid, resumed=resumed)
        self.say(f"> start {spec.run_id}" + (" (resuming from checkpoint)" if resumed else ""))
        try:
            code, reason = process.wait(timeout=self.run_timeout), ""
        except subprocess.TimeoutExpired:
            _kill(process)
            code, reason = -signal.SIGKILL, f"timed out after {time.time() - started:.0f} s (--run-timeout)"
        seconds = time.time() - started
        with self.lock:
            self.running.pop(spec.run_id, None)
        if code == 0 and is_finished(spec):
            with self.lock:
                self.result.finished.append(spec.run_id)
            self.log("finish", spec.run_id, seconds=seconds)
            done = len(self.result.finished) + len(self.result.skipped)
            return self.say(f"< done  {spec.run_id} in {_clock(seconds)} [{done}/{len(self.runs)}]")
        if self.stop.is_set():
            return self.log("interrupted", spec.run_id, seconds=seconds)
        return self.fail(spec, f"{reason or f'worker exited with code {code}'}; log: {spec.run_dir / WORKER_LOG}"
                         + (f"; rerun to resume it, or delete {spec.run_dir} to start this run afresh" if resumed
                            else ""),
                         seconds=seconds, returncode=code, tail=_tail(spec.run_dir / WORKER_LOG))

    def fail(self, spec: RunSpec, reason: str, **extra: Any) -> None:
        with self.lock:
            self.result.failed[spec.run_id] = reason
        self.log("fail", spec.run_id, reason=reason, **extra)
        tail = extra.get("tail")
        self.say(f"! FAILED {spec.run_id}: {reason}" + ("\n    " + tail.replace("\n", "\n    ") if tail else ""))

    def status_line(self) -> str:
        with self.lock:
            running = dict(self.running)
        parts = [f"{spec.run_id} ({_position(spec.run_dir)}, {_clock(time.time() - running[spec.run_id][1])})"
                 for spec in self.runs if spec.run_id in running]
        return (f"  {len(self.result.finished) + len(self.result.skipped)}/{len(self.runs)} done, "
                f"{len(self.result.failed)} failed; running: {'; '.join(parts)}")

    def log(self, event: str, run_id: str, **extra: Any) -> None:
        with self.lock:
            append_jsonl(self.root / LOG_FILE, {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "event": event,
                                                "run": run_id, **extra})


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


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"


def _tail(path: Path, lines: int = 6) -> str:
    return "\n".join(line[-300:] for line in _read(path).replace("\r", "\n").splitlines()[-lines:])


def _position(run_dir: Path) -> str:
    """Where a running run is, from the metrics it has written so far."""
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if isinstance(r.get("step"), int | float)]
    return f"{steps[-1].get('stage', 'rl')} step {int(steps[-1]['step'])}" if steps else "starting"


# ------------------------------------------------------------------------------------------------------ worker
def load_pipeline(target: str = DEFAULT_PIPELINE) -> Callable[[Any], Any]:
    """The callable named by 'module:function' (the contract of `trustclip.train.pipeline.run_pipeline`)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"pipeline {target!r}: expected 'module:function'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except AttributeError:
        raise ValueError(f"pipeline {target!r}: {module_name} has no attribute {attr!r}") from None


def _set_threads(threads: int) -> None:
    """Limit torch to `threads` intra-op threads (OMP_NUM_THREADS, set by the compare, covers the rest)."""
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):  # torch allows it once, before any parallel work
            torch.set_num_interop_threads(1)


def build_config(spec: dict[str, Any], run_dir: Path, resume: bool) -> Any:
    """TrainConfig of the run, writing into `run_dir` (RL from the shared SFT run's model, if it has one)."""
    from trustclip.models import is_saved_model
    from trustclip.train.config import TrainConfig, from_dict

    data = copy.deepcopy(spec["config"]) | {"output_dir": str(run_dir), "resume": resume}
    if spec.get("start_model"):
        start = (run_dir / spec["start_model"]).resolve()
        if not is_saved_model(start):
            raise FileNotFoundError(f"the SFT model this run starts from is missing: {start}")
        data["model"]["name_or_path"] = str(start)
    return from_dict(TrainConfig, data)


def _inherited_lock(fd: int) -> Any:
    """The run's lock, taken by the compare that started this worker and handed over as an open file descriptor;
    None if it is not that lock."""
    import fcntl

    try:
        handle = os.fdopen(fd, "a+")
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a no-op on the holder's own open file
    except OSError:
        return None
    return handle


def run_worker(run_dir: str | Path, threads: int = 1, resume: bool = False, lock_fd: int | None = None) -> int:
    """Run one spec to completion; returns a process exit code (0 = finished and marked complete)."""
    run_dir = Path(run_dir)
    spec = read_json(run_dir / SPEC_FILE)
    if not isinstance(spec, dict) or "config" not in spec:
        print(f"worker: {run_dir / SPEC_FILE} is missing or unreadable", file=sys.stderr)
        return 2
    lock = try_lock(run_dir / LOCK_FILE) if lock_fd is None else _inherited_lock(lock_fd)
    if lock is None:
        print(f"worker: {run_dir} is locked by another process", file=sys.stderr)
        return 3
    with lock:
        fn = load_pipeline(spec.get("pipeline") or DEFAULT_PIPELINE)  # the compare's --pipeline, in the spec
        _set_threads(threads)
        start = time.time()
        print(f"worker: run {spec['run_id']} ({spec['fingerprint']}), {threads} thread(s), resume={resume}", flush=True)
        fn(build_config(spec, run_dir, resume))
        if not isinstance(read_json(run_dir / SUMMARY_FILE), dict):
            print(f"worker: the pipeline returned but wrote no readable {SUMMARY_FILE}", file=sys.stderr)
            return 4
        write_json_atomic(run_dir / COMPLETE_FILE, {
            "run_id": spec["run_id"], "fingerprint": spec["fingerprint"], "seconds": time.time() - start,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "threads": threads, "resumed": resume})
    return 0


def _watch_parent(parent: int) -> None:
    """Exit hard (with the process group: reward workers) when the compare that started this worker is gone."""

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(2.0)
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(75)

    threading.Thread(target=loop, daemon=True, name="parent-watch").start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trustclip.compare.runner", description="one run of a compare")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    parser.add_argument("--lock-fd", type=int, default=None, help="open RUN_DIR/.lock of the compare")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    if (parent := os.environ.get(PARENT_ENV, "")).isdigit():
        _watch_parent(int(parent))
    return run_worker(args.run_dir, args.threads, args.resume, args.lock_fd)


if __name__ == "__main__":
    sys.exit(main())
