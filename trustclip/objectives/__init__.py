"""Pure-torch policy objectives (no trainer imports): the unified clipping framework and baselines."""

from trustclip.objectives import (  # noqa: F401  (register objectives)
    adaptive,
    clipping,
    covariance,
    dppo,
    reweighting,
    second_moment,
)
from trustclip.objectives.adaptive import DeltaController
from trustclip.objectives.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from trustclip.objectives.aggregation import AGGREGATIONS, aggregate
from trustclip.objectives.batch import PolicyBatch, make_batch
from trustclip.objectives.constraints import (
    BinaryDivergence,
    Constraint,
    DivergenceConstraint,
    FullKLConstraint,
    ProbabilityInterval,
    RatioInterval,
    custom_divergence,
    kl_constraint,
)
from trustclip.objectives.full_kl import full_vocab_logprobs
from trustclip.objectives.loss import compute_policy_loss, compute_token_loss
from trustclip.objectives.registry import (
    REGISTRY,
    Objective,
    TokenLoss,
    get_objective,
    list_objectives,
    ratio_bounds,
    register_objective,
)
from trustclip.objectives.statistics import PolicyMetrics, policy_metrics, reduce_statistics, token_statistics

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "REGISTRY", "BinaryDivergence", "Constraint", "DeltaController",
    "DivergenceConstraint", "FullKLConstraint", "Objective", "PolicyBatch", "PolicyMetrics", "ProbabilityInterval",
    "RatioInterval", "TokenLoss", "aggregate", "compute_advantages", "compute_policy_loss", "compute_token_loss",
    "custom_divergence", "full_vocab_logprobs", "get_objective", "kl_constraint", "list_objectives", "make_batch",
    "policy_metrics", "ratio_bounds", "reduce_statistics", "register_objective", "token_statistics",
]
