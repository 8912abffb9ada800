"""MoE analyses built on run_with_cache / run_with_hooks."""

from moelens.analysis.routing import RoutingTable, routing_table

__all__ = ["RoutingTable", "routing_table"]
