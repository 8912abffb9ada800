"""MoE analyses built on run_with_cache / run_with_hooks (analyses of corpus traces: moelens.traces)."""

from moelens.analysis.ablation import ablate_experts, ablate_experts_hooks, expert_mean_outputs
from moelens.analysis.coactivation import coactivation, coactivation_lift, coactivations
from moelens.analysis.compare import InterventionResult, compare_runs
from moelens.analysis.difference import ExpertDelta, activation_difference
from moelens.analysis.expert_effects import expert_loss_effects
from moelens.analysis.interventions import (
    force_route,
    force_route_hooks,
    patch_routing,
    patch_routing_hooks,
    steer_router,
    steer_router_hooks,
)
from moelens.analysis.misrouting import Misrouting, misrouting
from moelens.analysis.plots import plot_expert_loss_effects, plot_expert_usage, plot_routing, plot_selectivity, plot_subset_load
from moelens.analysis.routing import RoutingTable, routing_table
from moelens.analysis.super_experts import SuperExpert, SuperExperts, super_experts
from moelens.analysis.top_tokens import TopToken, TopTokens, top_tokens
from moelens.analysis.usage import ExpertUsage, expert_usage

__all__ = [
    "ExpertDelta",
    "ExpertUsage",
    "InterventionResult",
    "Misrouting",
    "RoutingTable",
    "SuperExpert",
    "SuperExperts",
    "TopToken",
    "TopTokens",
    "ablate_experts",
    "activation_difference",
    "ablate_experts_hooks",
    "coactivation",
    "coactivation_lift",
    "coactivations",
    "compare_runs",
    "expert_loss_effects",
    "expert_mean_outputs",
    "expert_usage",
    "force_route",
    "force_route_hooks",
    "misrouting",
    "patch_routing",
    "patch_routing_hooks",
    "plot_expert_loss_effects",
    "plot_expert_usage",
    "plot_selectivity",
    "plot_subset_load",
    "plot_routing",
    "routing_table",
    "steer_router",
    "steer_router_hooks",
    "super_experts",
    "top_tokens",
]
