"""A comparison's runs, resumable, `jobs` at a time: each run is a worker process (this module as __main__) that trains
RUN_DIR/run_spec.json's config into RUN_DIR as `trustclip train --config ... [--resume]` would, then marks it complete.
Not the train CLI itself: its --resume reads the config.yaml that the real pipeline writes and the tests' `--pipeline`
stand-in does not."""

from __future__ import annotations

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
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from pathlib import Path
from typing import Any

from trustclip.compare.plan import SPEC_FILE, RunSpec
from trustclip.files import append_jsonl, read_json, try_lock, write_json_atomic
from trustclip.train.config import TrainConfig, from_dict

LOG_FILE, WORKER_LOG, COMPARE_LOCK = "compare_log.jsonl", "worker.log", ".compare.lock"
COMPLETE_FILE, SUMMARY_FILE = "run_complete.json", "summary.json"
PARENT_ENV = "TRUSTCLIP_COMPARE_PARENT"  # the compare's pid: a worker started after its death exits too
KILL_GRACE = 10.0  # seconds workers get to exit after SIGTERM before SIGKILL
# The worker runs this module as __main__ from the package the compare itself imported: `python -m` would put the
# working directory first on sys.path, so a compare started from one checkout could run its workers from another.
WORKER_START = (f"import runpy, sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r}); "
                "runpy.run_module('trustclip.compare.runner', run_name='__main__', alter_sys=True)")


class ChangedRunError(ValueError):
    """A run directory holds a run made with different settings."""


def is_finished(spec: RunSpec) -> bool:
    """True when the run completed with exactly this spec's settings."""
    marker = read_json(spec.run_dir / COMPLETE_FILE)
    return (isinstance(marker, dict) and marker.get("fingerprint") == spec.fingerprint()
            and isinstance(read_json(spec.run_dir / SUMMARY_FILE), dict))


def check_runs(runs: Sequence[RunSpec]) -> None:
    """Every run's configuration as `trustclip train` checks it (`check_run`), before any run starts."""
    from trustclip.train.checks import check_run

    for spec in {spec.fingerprint(): spec for spec in runs}.values():
        try:
            check_run(from_dict(TrainConfig, spec.config))
        except (ValueError, FileNotFoundError) as err:
            raise ValueError(f"run {spec.run_id}: {err}") from None


def check_changed(runs: Sequence[RunSpec], redo_changed: bool = False) -> None:
    """Refuse (ChangedRunError) runs whose directory holds a spec with another fingerprint, or with `redo_changed`
    delete those directories (their runs are then redone)."""
    changed = [spec for spec in runs if isinstance(old := read_json(spec.run_dir / SPEC_FILE), dict)
               and old.get("fingerprint") != spec.fingerprint()]
    if changed and not redo_changed:
        names = ", ".join(s.run_id for s in changed[:5]) + (" ..." if len(changed) > 5 else "")
        raise ChangedRunError(f"{len(changed)} run(s) in {changed[0].root} were made with different settings "
                              f"({names}); use another --output-dir, or --redo-changed to delete and redo them")
    for spec in changed:
        shutil.rmtree(spec.run_dir)


def prepare_run_dir(spec: RunSpec, pipeline: str | None = None) -> bool:
    """Make the run directory ready to start; True when the run resumes earlier progress (state.json or a
    checkpoint is there), else what an earlier attempt left is removed."""
    run_dir = spec.run_dir
    resume = run_dir.is_dir() and (
        (run_dir / "state.json").is_file() or any(p.is_dir() for p in run_dir.rglob("checkpoint-*")))
    if run_dir.is_dir() and not resume:
        shutil.rmtree(run_dir)
    write_json_atomic(run_dir / SPEC_FILE, {**spec.to_dict(), **({"pipeline": pipeline} if pipeline else {})})
    return resume


def acquire_compare_lock(root: Path) -> Any:
    """The pool's lock (an open file; closing it releases it); raises if a compare, or its workers, hold it. The workers
    inherit it, so that a rerun cannot start while a killed compare's workers still write."""
    handle = try_lock(Path(root) / COMPARE_LOCK)
    if handle is None:
        holder = (Path(root) / COMPARE_LOCK).read_text().strip() or "?"
        raise RuntimeError(f"another compare (pid {holder}) or its workers are still running in {root}; wait for "
                           "them or stop them")
    return handle


def execute(runs: Sequence[RunSpec], root: str | Path, *, log_dir: str | Path | None = None, jobs: int | None = None,
            threads: int | None = None, redo_changed: bool = False, pipeline: str | None = None,
            progress: Callable[[str], None] = print) -> tuple[dict[str, str], bool]:
    """Run every unfinished run of the pool `root`, `jobs` at a time (default min(2, cores)), each worker with `threads`
    torch threads (default cores // jobs, so parallel runs do not oversubscribe the cores), in plan order (SFT runs
    first; an RL run starts once its SFT run has ended); starts, finishes and failures go to `log_dir` (default
    `root`)/compare_log.jsonl. Each of `jobs` threads waits on one worker at a time; the calling thread takes Ctrl-C.
    Safe to call again after any interruption (a partial run resumes). Returns ({failed run id: why}, interrupted)."""
    for name, value in (("jobs", jobs), ("threads", threads)):
        if value is not None and not value > 0:  # jobs <= 0 would wait for a free slot forever
            raise ValueError(f"{name} must be > 0, got {value!r}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    jobs = jobs or max(1, min(2, cores))
    threads = threads or max(1, cores // jobs)
    finished, failed, say = [], {}, progress  # run ids finished by this call; failed ones -> why
    interrupted, t0 = False, time.time()
    running: dict[str, subprocess.Popen] = {}  # run id -> its worker
    lock, stopping = threading.Lock(), threading.Event()  # `lock`: the run lists, `running` and the log
    env = {**os.environ, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           **dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"), str(threads))}  # workers'

    def log(event: str, run_id: str, **extra: Any) -> None:
        append_jsonl(Path(log_dir or root) / LOG_FILE, {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "event": event,
                                                        "run": run_id, **extra})

    def fail(spec: RunSpec, reason: str, **extra: Any) -> None:
        failed[spec.run_id] = reason
        log("fail", spec.run_id, reason=reason, **extra)
        tail = extra.get("tail")
        say(f"! FAILED {spec.run_id}: {reason}" + ("\n    " + tail.replace("\n", "\n    ") if tail else ""))

    def run(spec: RunSpec, sft: Future | None, lock_fd: int) -> None:
        """One run in a worker process, once its SFT run (if it has one) has ended, until it ends or is stopped."""
        wait([sft] if sft else [])
        with lock:
            if stopping.is_set():
                return
            if spec.depends_on is not None and not is_finished(spec.depends_on):
                return fail(spec, f"its SFT run {spec.depends_on.run_id} failed")
            resumed = prepare_run_dir(spec, pipeline)
            cmd = [sys.executable, "-c", WORKER_START, str(spec.run_dir), str(threads),
                   *(["--resume"] if resumed else [])]
            with (spec.run_dir / WORKER_LOG).open("a", encoding="utf-8") as worker_log:  # its own group, for _kill
                process = subprocess.Popen(cmd, stdout=worker_log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True, pass_fds=(lock_fd,))
            running[spec.run_id], started = process, time.time()
            log("start", spec.run_id, pid=process.pid, resumed=resumed)
            say(f"> start {spec.run_id}" + (" (resuming from checkpoint)" if resumed else ""))
        process.wait()
        seconds = time.time() - started
        with lock:
            del running[spec.run_id]
            if process.returncode == 0 and is_finished(spec):
                finished.append(spec.run_id)
                log("finish", spec.run_id, seconds=seconds)
                clock = time.strftime("%H:%M:%S", time.gmtime(seconds))
                say(f"< done  {spec.run_id} in {clock} [{len(finished) + len(skipped)}/{len(runs)}]")
            elif stopping.is_set():
                log("interrupted", spec.run_id, seconds=seconds)
            else:
                path = spec.run_dir / WORKER_LOG
                lines = path.read_text(errors="replace").replace("\r", "\n").strip().splitlines()
                again = f"; rerun to resume it, or delete {spec.run_dir} to start this run afresh" if resumed else ""
                fail(spec, f"worker exited with code {process.returncode}; log: {path}{again}", seconds=seconds,
                     returncode=process.returncode, tail="\n".join(x[-300:] for x in lines[-6:]))

    with acquire_compare_lock(Path(root)) as pool_lock, ThreadPoolExecutor(jobs, "compare-run") as pool:
        check_changed(runs, redo_changed)
        skipped = [spec.run_id for spec in runs if is_finished(spec)]
        todo = [spec for spec in runs if spec.run_id not in skipped]
        for run_id in skipped:
            log("skip", run_id)
        say(f"{len(runs)} runs: {len(skipped)} already finished, {len(todo)} to run ({jobs} in parallel, "
            f"{threads} torch thread(s) each)")
        handlers = {}
        with contextlib.suppress(ValueError):  # not the main thread: no handlers
            handlers = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            futures: dict[str, Future] = {}
            for spec in sorted(todo, key=lambda spec: spec.kind != "sft"):  # FIFO: an SFT run starts before its RL
                sft = futures.get(spec.depends_on.run_id) if spec.depends_on else None
                futures[spec.run_id] = pool.submit(run, spec, sft, pool_lock.fileno())
            for future in as_completed(futures.values()):
                future.result()  # an error in a pool thread stops the compare
        except KeyboardInterrupt:
            interrupted = True
            say(f"interrupted: stopping {len(running)} running run(s); rerun the same command to resume")
        finally:
            stopping.set()  # no run starts now; those running are stopped, their threads log them as interrupted
            with lock:
                processes = list(running.values())
            _kill(processes)
            pool.shutdown(cancel_futures=True)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    say(f"ran {len(finished)} run(s) in {time.time() - t0:.0f} s; {len(skipped)} were already finished; "
        f"{len(failed)} failed")
    return failed, interrupted


def _stop(*_: Any) -> None:
    """SIGINT / SIGTERM: stop the compare, once (a second Ctrl-C must not cut the stopping of the workers short)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def _kill(processes: Sequence[subprocess.Popen]) -> None:
    """SIGTERM the workers' process groups, SIGKILL those still there after KILL_GRACE seconds."""
    deadline = time.time() + KILL_GRACE
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [process for process in processes if process.poll() is None]
        for process in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
        for process in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.time()) if sig == signal.SIGTERM else None)


# ------------------------------------------------------------------------------------------------------ worker
def build_config(spec: dict[str, Any], run_dir: Path, resume: bool) -> Any:
    """TrainConfig of the run, writing into `run_dir` (RL from the shared SFT run's model, if it has one)."""
    from trustclip.models import is_saved_model

    data = copy.deepcopy(spec["config"]) | {"output_dir": str(run_dir), "resume": resume}
    if spec.get("start_model"):
        start = (run_dir / spec["start_model"]).resolve()
        if not is_saved_model(start):
            raise FileNotFoundError(f"the SFT model this run starts from is missing: {start}")
        data["model"]["name_or_path"] = str(start)
    return from_dict(TrainConfig, data)


def run_worker(run_dir: str | Path, threads: int = 1, resume: bool = False) -> int:
    """Run one spec to completion; returns a process exit code (0 = finished and marked complete). Torch's threads
    follow OMP_NUM_THREADS, which the compare sets."""
    run_dir = Path(run_dir)
    spec = read_json(run_dir / SPEC_FILE)  # the compare wrote it just before it started this worker
    module, _, name = spec.get("pipeline", "trustclip.train.pipeline:run_pipeline").partition(":")
    start = time.time()
    print(f"worker: run {spec['run_id']} ({spec['fingerprint']}), {threads} thread(s), resume={resume}", flush=True)
    getattr(importlib.import_module(module), name)(build_config(spec, run_dir, resume))
    if not isinstance(read_json(run_dir / SUMMARY_FILE), dict):
        print(f"worker: the pipeline returned but wrote no readable {SUMMARY_FILE}", file=sys.stderr)
        return 4
    write_json_atomic(run_dir / COMPLETE_FILE, {
        "run_id": spec["run_id"], "fingerprint": spec["fingerprint"], "seconds": time.time() - start,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "threads": threads, "resumed": resume})
    return 0


def _exit_with_parent(parent: int) -> None:
    """(A worker's daemon thread) once the compare that started the worker is gone, kill its process group (the run's
    own subprocesses too) and exit: a killed compare leaves no orphan writing its run."""
    while os.getppid() == parent:
        time.sleep(2.0)
    with contextlib.suppress(OSError):
        os.killpg(os.getpid(), signal.SIGKILL)  # the worker leads its group (start_new_session)
    os._exit(75)


if __name__ == "__main__":  # a worker started by the compare: RUN_DIR THREADS [--resume]
    if (parent := os.environ.get(PARENT_ENV, "")).isdigit():
        threading.Thread(target=_exit_with_parent, args=(int(parent),), daemon=True, name="parent-watch").start()
    sys.exit(run_worker(sys.argv[1], max(1, int(sys.argv[2])), "--resume" in sys.argv[3:]))
