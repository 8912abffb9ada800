"""MoE analyses built on run_with_cache / run_with_hooks (analyses of corpus traces: moelens.traces)."""

from moelens.analysis.ablation import ablate_experts, ablate_experts_hooks, expert_mean_outputs
from moelens.analysis.coactivation import coactivation, coactivation_lift, coactivations
from moelens.analysis.compare import InterventionResult, compare_runs
from moelens.analysis.difference import ExpertDelta, activation_difference
from moelens.analysis.expert_effects import expert_loss_effects
from moelens.analysis.expert_lens import ExpertLens, expert_logit_lens
from moelens.analysis.interventions import (
    force_route,
    force_route_hooks,
    patch_routing,
    patch_routing_hooks,
    steer_router,
    steer_router_hooks,
)
from moelens.analysis.misrouting import Misrouting, misrouting
from moelens.analysis.paths import RoutingOverlap, RoutingPaths, routing_overlap, routing_paths
from moelens.analysis.plots import (
    plot_expert_lens,
    plot_expert_loss_effects,
    plot_expert_usage,
    plot_routing,
    plot_routing_paths,
    plot_selectivity,
    plot_specialization,
    plot_subset_load,
)
from moelens.analysis.routing import RoutingTable, routing_table
from moelens.analysis.specialization import Specialization, expert_specialization, jensen_shannon
from moelens.analysis.super_experts import SuperExpert, SuperExperts, super_experts
from moelens.analysis.top_tokens import TopToken, TopTokens, top_tokens
from moelens.analysis.usage import ExpertUsage, expert_usage

__all__ = [
    "ExpertDelta",
    "ExpertLens",
    "ExpertUsage",
    "InterventionResult",
    "Misrouting",
    "RoutingOverlap",
    "RoutingPaths",
    "RoutingTable",
    "Specialization",
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
    "expert_logit_lens",
    "expert_loss_effects",
    "expert_mean_outputs",
    "expert_specialization",
    "expert_usage",
    "force_route",
    "force_route_hooks",
    "jensen_shannon",
    "misrouting",
    "patch_routing",
    "patch_routing_hooks",
    "plot_expert_lens",
    "plot_expert_loss_effects",
    "plot_expert_usage",
    "plot_routing_paths",
    "plot_selectivity",
    "plot_specialization",
    "plot_subset_load",
    "plot_routing",
    "routing_overlap",
    "routing_paths",
    "routing_table",
    "steer_router",
    "steer_router_hooks",
    "super_experts",
    "top_tokens",
]
