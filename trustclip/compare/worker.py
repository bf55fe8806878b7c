"""One training run of a comparison, in its own process: `python -m trustclip.compare.worker RUN_DIR`.

Reads `RUN_DIR/run_spec.json` (written by the executor), limits torch to `--threads` threads, runs the
training pipeline into RUN_DIR, and only when it returns writes `RUN_DIR/run_complete.json` atomically.
A run counts as finished only when that marker exists, names the run's fingerprint and the pipeline's
`summary.json` is readable: a run killed at any point is never mistaken for a finished one.

While it runs, the worker holds an exclusive lock on `RUN_DIR/.lock` (released by the OS when the process
dies; started by a compare, it inherits the compare's, `--lock-fd`), so a second compare cannot start the same
run. Started by a compare (`TRUSTCLIP_COMPARE_PARENT` set), it exits when that compare dies, so a killed compare
leaves no orphans behind.

The pipeline is `trustclip.train.pipeline.run_pipeline(TrainConfig) -> summary`; `--pipeline module:function`
(or the `pipeline` field of the spec) swaps in another callable with the same contract.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trustclip.compare.plan import SPEC_FILE
from trustclip.files import read_json, try_lock, write_json_atomic

COMPLETE_FILE = "run_complete.json"
SUMMARY_FILE = "summary.json"
LOCK_FILE = ".lock"
PARENT_ENV = "TRUSTCLIP_COMPARE_PARENT"
DEFAULT_PIPELINE = "trustclip.train.pipeline:run_pipeline"


def load_pipeline(target: str = DEFAULT_PIPELINE) -> Callable[[Any], Any]:
    """The callable named by 'module:function'."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"pipeline {target!r}: expected 'module:function'")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"pipeline {target!r}: {module_name} has no attribute {attr!r}") from None


def _watch_parent(parent: int) -> None:
    """Exit hard when the compare that started this worker is gone (killed with SIGKILL, say)."""

    def loop() -> None:
        while True:
            time.sleep(2.0)
            if os.getppid() != parent:
                if os.getpgrp() == os.getpid():  # our own process group: take helpers (reward workers) along
                    os.killpg(os.getpid(), signal.SIGKILL)
                os._exit(75)

    threading.Thread(target=loop, daemon=True, name="parent-watch").start()


def _set_threads(threads: int) -> None:
    """Limit torch (when the pipeline uses it) to `threads` intra-op threads; OMP_NUM_THREADS, set by the
    executor, covers the libraries that read it."""
    if "torch" not in sys.modules:
        return
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # torch allows it once, before any parallel work
        torch.set_num_interop_threads(1)


def build_config(spec: dict[str, Any], run_dir: Path, resume: bool) -> Any:
    """TrainConfig of the run, writing into `run_dir`."""
    from trustclip.models import is_saved_model
    from trustclip.train.config import TrainConfig, from_dict

    data = copy.deepcopy(spec["config"])
    data["output_dir"] = str(run_dir)
    data["resume"] = resume
    if spec.get("start_model"):  # RL from the shared SFT run's model
        start = (run_dir / spec["start_model"]).resolve()
        if not is_saved_model(start):
            raise FileNotFoundError(f"the SFT model this run starts from is missing: {start}")
        data["model"]["name_or_path"] = str(start)
    return from_dict(TrainConfig, data)


def _inherited_lock(fd: int) -> Any:
    """The run's lock, taken by the compare that started this worker and handed over as an open file descriptor
    (the same open file: the lock is held while either process keeps it). None if it is not that lock."""
    import fcntl

    try:
        handle = os.fdopen(fd, "a+")
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a no-op on the holder's own open file
    except OSError:
        return None
    return handle


def run_worker(run_dir: str | Path, threads: int = 1, resume: bool = False, pipeline: str | None = None,
               lock_fd: int | None = None) -> int:
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
        fn = load_pipeline(pipeline or spec.get("pipeline") or DEFAULT_PIPELINE)
        _set_threads(threads)
        start = time.time()
        print(f"worker: run {spec['run_id']} ({spec['fingerprint']}), {threads} thread(s), resume={resume}",
              flush=True)
        fn(build_config(spec, run_dir, resume))
        if not isinstance(read_json(run_dir / SUMMARY_FILE), dict):
            print(f"worker: the pipeline returned but wrote no readable {SUMMARY_FILE}", file=sys.stderr)
            return 4
        write_json_atomic(run_dir / COMPLETE_FILE, {
            "run_id": spec["run_id"], "fingerprint": spec["fingerprint"], "seconds": time.time() - start,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "threads": threads, "resumed": resume,
        })
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trustclip.compare.worker", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    parser.add_argument("--pipeline", default=None, help="module:function replacing the training pipeline")
    parser.add_argument("--lock-fd", type=int, default=None,
                        help="open file descriptor of RUN_DIR/.lock, locked by the compare that starts this worker")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    parent = os.environ.get(PARENT_ENV)
    if parent and parent.isdigit():
        _watch_parent(int(parent))
    return run_worker(args.run_dir, args.threads, args.resume, args.pipeline, args.lock_fd)


if __name__ == "__main__":
    sys.exit(main())
