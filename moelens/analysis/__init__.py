"""MoE analyses built on run_with_cache / run_with_hooks (analyses of corpus traces: moelens.traces)."""

from moelens.analysis.ablation import ablate_experts, ablate_experts_hooks, expert_mean_outputs
from moelens.analysis.coactivation import coactivation, coactivation_lift, coactivations
from moelens.analysis.compare import InterventionResult, compare_runs
from moelens.analysis.difference import ExpertDelta, activation_difference
from moelens.analysis.interventions import (
    force_route,
    force_route_hooks,
    patch_routing,
    patch_routing_hooks,
    steer_router,
    steer_router_hooks,
)
from moelens.analysis.plots import plot_expert_usage, plot_routing, plot_selectivity, plot_subset_load
from moelens.analysis.routing import RoutingTable, routing_table
from moelens.analysis.top_tokens import TopToken, TopTokens, top_tokens
from moelens.analysis.usage import ExpertUsage, expert_usage

__all__ = [
    "ExpertDelta",
    "ExpertUsage",
    "InterventionResult",
    "RoutingTable",
    "TopToken",
    "TopTokens",
    "ablate_experts",
    "activation_difference",
    "ablate_experts_hooks",
    "coactivation",
    "coactivation_lift",
    "coactivations",
    "compare_runs",
    "expert_mean_outputs",
    "expert_usage",
    "force_route",
    "force_route_hooks",
    "patch_routing",
    "patch_routing_hooks",
    "plot_expert_usage",
    "plot_selectivity",
    "plot_subset_load",
    "plot_routing",
    "routing_table",
    "steer_router",
    "steer_router_hooks",
    "top_tokens",
]
