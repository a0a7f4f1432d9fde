"""HeteroAuto: the cost model, memory model, plan search and baselines. No JAX imports here."""

from h2jax.planner.baselines import Baseline, hetero_speedup_ratio, homogeneous_baselines
from h2jax.planner.chip_split import ProofProgress
from h2jax.planner.cost_model import CostOptions, iteration_time, stage_costs
from h2jax.planner.heteroauto import PlanResult, plan_cluster, predict
from h2jax.planner.profile import Profile, ProfileEntry, ProfileError, load_profile, save_profile
from h2jax.planner.search import Candidate, PlannerError, SearchStats, candidate_plan, top_k
from h2jax.planner.stage_cost import StageCost

__all__ = [
    "Baseline", "Candidate", "CostOptions", "PlanResult", "PlannerError", "Profile", "ProfileEntry",
    "ProfileError", "ProofProgress", "SearchStats", "StageCost", "candidate_plan", "hetero_speedup_ratio",
    "homogeneous_baselines", "iteration_time", "load_profile", "plan_cluster", "predict",
    "save_profile", "stage_costs", "top_k",
]
