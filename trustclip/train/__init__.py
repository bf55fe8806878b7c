"""`trustclip train` as a library: configuration dataclasses, YAML recipes with `--set` overrides, and the
pipeline SFT for format -> RLVR -> evaluation.

    from trustclip.train import load_config, run_pipeline
    summary = run_pipeline(load_config("recipes/qwen3_1.7b_atr.yaml", ["rl.max_steps=10"], output_dir="runs/x"))

`run_pipeline(config) -> dict` writes everything into `config.output_dir` (see `trustclip.train.pipeline`);
`check_run(config)`, its first step, checks everything the run needs without doing any of it and returns the
`CheckedRun` (the config and its stages' TRL configs, built once) that `run_pipeline` also takes.
"""

from trustclip.settings import STAGES, TrainConfig, load_config, option_table
from trustclip.train.checks import CheckedRun, check_run
from trustclip.train.pipeline import run_pipeline

__all__ = ["STAGES", "CheckedRun", "TrainConfig", "check_run", "load_config", "option_table", "run_pipeline"]
