"""MoE analyses built on run_with_cache / run_with_hooks."""

from moelens.analysis.ablation import ablate_experts, ablate_experts_hooks, expert_mean_outputs
from moelens.analysis.coactivation import coactivation, coactivations
from moelens.analysis.compare import InterventionResult, compare_runs
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
from moelens.analysis.traces import (
    ConsecutiveRouting,
    ExpertDelta,
    Selectivity,
    SubsetLoad,
    Trace,
    TraceExpertLoad,
    TraceTopTokens,
    delta_experts,
    delta_steer_hooks,
    trace_activation_difference,
    trace_coactivation,
    trace_coactivations,
    trace_consecutive,
    trace_expert_load,
    trace_selectivity,
    trace_subset_load,
    trace_top_tokens,
)
from moelens.analysis.trace_report import trace_report
from moelens.analysis.usage import ExpertUsage, expert_usage

__all__ = [
    "ConsecutiveRouting",
    "ExpertDelta",
    "ExpertUsage",
    "InterventionResult",
    "RoutingTable",
    "Selectivity",
    "SubsetLoad",
    "TopToken",
    "TopTokens",
    "Trace",
    "TraceExpertLoad",
    "TraceTopTokens",
    "ablate_experts",
    "ablate_experts_hooks",
    "coactivation",
    "coactivations",
    "compare_runs",
    "delta_experts",
    "delta_steer_hooks",
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
    "trace_activation_difference",
    "trace_coactivation",
    "trace_coactivations",
    "trace_consecutive",
    "trace_expert_load",
    "trace_report",
    "trace_selectivity",
    "trace_subset_load",
    "trace_top_tokens",
]
