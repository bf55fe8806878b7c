"""A comparison's runs, resumable, `jobs` at a time: each run is a worker process (this module as __main__) training
RUN_DIR/run_spec.json's config into RUN_DIR as `trustclip train --config ... [--resume]` would (not the train CLI: its
--resume reads the config.yaml that the tests' stand-in pipeline does not write). One thread starts and polls the
workers. Ctrl-C, SIGTERM and SIGHUP stop them; after a SIGKILL of the compare they finish the runs they are on (nothing
is lost), holding the pool's lock."""

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
from pathlib import Path
from typing import Any

from trustclip.compare.plan import SPEC_FILE, RunSpec
from trustclip.files import append_jsonl, read_json, try_lock, write_json_atomic
from trustclip.settings import TrainConfig, from_dict

LOG_FILE, WORKER_LOG, COMPARE_LOCK, SUMMARY_FILE = "compare_log.jsonl", "worker.log", ".compare.lock", "summary.json"
KILL_GRACE = 10.0  # seconds workers get to exit after SIGTERM before SIGKILL
POLL = 0.2  # seconds between looks at the running workers
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal was closed
# The worker runs this module as __main__ from the package the compare itself imported: `python -m` would put the
# working directory first on sys.path, so a compare started from one checkout could run its workers from another.
WORKER_START = (f"import runpy, sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r}); "
                "runpy.run_module('trustclip.compare.runner', run_name='__main__', alter_sys=True)")


class ChangedRunError(ValueError):
    """A run directory holds a run made with different settings."""


def is_finished(spec: RunSpec) -> bool:
    """True when the run completed with exactly this spec's settings: its run_spec.json has the spec's fingerprint
    and the pipeline wrote summary.json, which it writes last."""
    saved = read_json(spec.run_dir / SPEC_FILE)
    return (isinstance(saved, dict) and saved.get("fingerprint") == spec.fingerprint()
            and isinstance(read_json(spec.run_dir / SUMMARY_FILE), dict))


def check_runs(runs: Sequence[RunSpec]) -> None:
    """Every run's configuration as `trustclip train` checks it (`check_run`), before any run starts."""
    from trustclip.train.checks import check_run

    for spec in {spec.fingerprint(): spec for spec in runs}.values():
        try:
            check_run(from_dict(TrainConfig, spec.config))
        except (ValueError, FileNotFoundError) as err:
            raise ValueError(f"run {spec.run_id}: {err}") from None


def check_changed(runs: Sequence[RunSpec]) -> None:
    """Refuse (ChangedRunError) runs whose directory holds a spec with another fingerprint: a pool never mixes the
    numbers of two settings, and only the user deletes results."""
    changed = [spec for spec in runs if isinstance(old := read_json(spec.run_dir / SPEC_FILE), dict)
               and old.get("fingerprint") != spec.fingerprint()]
    if changed:
        names = ", ".join(str(s.run_dir) for s in changed[:5]) + (" ..." if len(changed) > 5 else "")
        raise ChangedRunError(f"{len(changed)} run(s) in {changed[0].root} were made with different settings; use "
                              f"another --output-dir (or --runs-dir), or delete their folders to redo them: {names}")


def prepare_run_dir(spec: RunSpec, pipeline: str | None = None) -> bool:
    """Make the run directory ready to start; True when the run resumes earlier progress (the pipeline's state.json,
    written before any checkpoint, is there), else what an earlier attempt left is removed."""
    resume = (spec.run_dir / "state.json").is_file()
    if spec.run_dir.is_dir() and not resume:
        shutil.rmtree(spec.run_dir)
    write_json_atomic(spec.run_dir / SPEC_FILE, {**spec.to_dict(), **({"pipeline": pipeline} if pipeline else {})})
    return resume


def execute(runs: Sequence[RunSpec], root: str | Path, *, log_dir: str | Path | None = None, jobs: int | None = None,
            threads: int | None = None, pipeline: str | None = None, progress: Callable[[str], None] = print,
            on_locked: Callable[[], None] = lambda: None) -> tuple[dict[str, str], bool]:
    """Run every unfinished run of the pool `root`, `jobs` at a time (default min(2, cores)), each worker with `threads`
    torch threads (default cores // jobs, so parallel runs do not oversubscribe the cores): SFT runs first, then the
    others in plan order, an RL run once its SFT run has ended. Starts, finishes and failures go to `log_dir` (default
    `root`)/compare_log.jsonl; `on_locked` is called once the pool is locked and its runs checked. Safe to call again
    after any interruption (a partial run resumes). Returns ({failed run id: why}, interrupted)."""
    for name, value in (("jobs", jobs), ("threads", threads)):
        if value is not None and not value > 0:  # jobs <= 0 would wait for a free slot forever
            raise ValueError(f"{name} must be > 0, got {value!r}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    jobs = jobs or max(1, min(2, cores))
    threads = threads or max(1, cores // jobs)
    finished, failed, say, t0 = [], {}, progress, time.time()  # run ids finished by this call; failed ones -> why
    running: dict[str, tuple[RunSpec, subprocess.Popen, float, bool]] = {}  # run id -> (spec, worker, start, resumed)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           **dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"), str(threads))}  # workers'

    def log(event: str, run_id: str, **extra: Any) -> None:
        append_jsonl(Path(log_dir or root) / LOG_FILE, {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "event": event,
                                                        "run": run_id, **extra})

    def fail(spec: RunSpec, reason: str, **extra: Any) -> None:
        failed[spec.run_id] = reason
        log("fail", spec.run_id, reason=reason, **extra)
        tail = extra.get("tail")
        say(f"! FAILED {spec.run_id}: {reason}" + ("\n    " + tail.replace("\n", "\n    ") if tail else ""))

    def start(spec: RunSpec, lock_fd: int) -> None:
        """A worker for the run, in its own process group (for `_kill`)."""
        resumed = prepare_run_dir(spec, pipeline)
        cmd = [sys.executable, "-c", WORKER_START, str(spec.run_dir), *(["--resume"] if resumed else [])]
        with (spec.run_dir / WORKER_LOG).open("a", encoding="utf-8") as worker_log:
            process = subprocess.Popen(cmd, stdout=worker_log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True, pass_fds=(lock_fd,))
        running[spec.run_id] = spec, process, time.time(), resumed
        log("start", spec.run_id, pid=process.pid, resumed=resumed)
        say(f"> start {spec.run_id}" + (" (resuming from checkpoint)" if resumed else ""))

    def end(run_id: str) -> None:
        """The run whose worker has exited: finished, or failed with the end of its log."""
        spec, process, started, resumed = running.pop(run_id)
        seconds = time.time() - started
        if process.returncode == 0 and is_finished(spec):
            finished.append(spec.run_id)
            log("finish", spec.run_id, seconds=seconds)
            clock = time.strftime("%H:%M:%S", time.gmtime(seconds))
            return say(f"< done  {spec.run_id} in {clock} [{len(finished) + len(skipped)}/{len(runs)}]")
        if stopping.is_set():  # it ended with the compare (a scheduler signals every process of the job): not a failure
            return log("interrupted", spec.run_id, seconds=seconds)
        path = spec.run_dir / WORKER_LOG
        lines = path.read_text(errors="replace").replace("\r", "\n").strip().splitlines()
        why = (f"worker exited with code {process.returncode}" if process.returncode
               else f"the pipeline returned without writing {SUMMARY_FILE}")
        again = f"; rerun to resume it, or delete {spec.run_dir} to start this run afresh" if resumed else ""
        fail(spec, f"{why}; log: {path}{again}", seconds=seconds, returncode=process.returncode,
             tail="\n".join(x[-300:] for x in lines[-6:]))

    # The pool's lock: the workers inherit it, so a rerun cannot start while a killed compare's workers still write.
    if (pool_lock := try_lock(Path(root) / COMPARE_LOCK)) is None:
        raise RuntimeError(f"another compare (pid {(Path(root) / COMPARE_LOCK).read_text().strip() or '?'}) or its "
                           f"workers (`pgrep -f {__name__}`) are still running in {root}; wait for them or stop them")
    stopping = threading.Event()  # set by a STOP_SIGNAL: the loop ends, the running workers are stopped

    def stop(*_: Any) -> None:
        """A STOP_SIGNAL: stop the compare, once (a second Ctrl-C must not cut the stopping of the workers short)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        stopping.set()

    with pool_lock:
        check_changed(runs)
        on_locked()
        skipped = [spec.run_id for spec in runs if is_finished(spec)]
        # plan order, seed-major with each seed's SFT run first: a stopped compare has complete seeds, and a free
        # worker passes over an RL run whose SFT run is not finished (below) to the next seed's SFT run
        queue = [spec for spec in runs if spec.run_id not in skipped]
        for run_id in skipped:
            log("skip", run_id)
        say(f"{len(runs)} runs: {len(skipped)} already finished, {len(queue)} to run ({jobs} in parallel, "
            f"{threads} torch thread(s) each)")
        # the handlers to restore, read before any is set; one ignored (nohup, a background job) stays ignored
        main = threading.current_thread() is threading.main_thread()  # (only the main thread sets handlers)
        handlers = {sig: h for sig in STOP_SIGNALS if main and (h := signal.getsignal(sig)) is not signal.SIG_IGN}
        for sig in handlers:
            signal.signal(sig, stop)
        try:
            while (queue or running) and not stopping.is_set():
                waiting = {spec.run_id for spec in queue} | set(running)  # an RL run waits while its SFT run does
                for spec in [s for s in queue if not (s.depends_on and s.depends_on.run_id in waiting)]:
                    if len(running) == jobs:
                        break
                    queue.remove(spec)
                    if spec.depends_on is not None and not is_finished(spec.depends_on):
                        fail(spec, f"its SFT run {spec.depends_on.run_id} failed")
                    else:
                        start(spec, pool_lock.fileno())
                for run_id in [run_id for run_id, (_, process, *_) in running.items() if process.poll() is not None]:
                    end(run_id)
                time.sleep(POLL)
        finally:  # also on an error: no worker outlives the loop
            _kill([process for _, process, *_ in running.values()])
            for run_id, (_, _, started, _) in running.items():
                log("interrupted", run_id, seconds=time.time() - started)
            for sig, handler in handlers.items():
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: a handler set in C
            if stopping.is_set():  # said last: after SIGHUP there may be no terminal to say it to
                say(f"interrupted: stopped {len(running)} running run(s); rerun the same command to resume")
    say(f"ran {len(finished)} run(s) in {time.time() - t0:.0f} s; {len(skipped)} were already finished; "
        f"{len(failed)} failed")
    return failed, stopping.is_set()


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


def run_worker(run_dir: str | Path, resume: bool = False) -> None:
    """Train one run into `run_dir` (the pipeline writes summary.json last: the run is then finished). Torch's threads
    follow OMP_NUM_THREADS, which the compare sets."""
    run_dir = Path(run_dir)
    spec = read_json(run_dir / SPEC_FILE)  # the compare wrote it just before it started this worker
    module, _, name = spec.get("pipeline", "trustclip.train.pipeline:run_pipeline").partition(":")
    print(f"worker: run {spec['run_id']} ({spec['fingerprint']}), resume={resume}", flush=True)
    getattr(importlib.import_module(module), name)(build_config(spec, run_dir, resume))


if __name__ == "__main__":  # a worker started by the compare: RUN_DIR [--resume]
    run_worker(sys.argv[1], "--resume" in sys.argv[2:])
