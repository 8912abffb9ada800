"""Routed-expert computation: one entry point, `routed_experts`, with a torch path (reference)."""

from moelens.kernels.experts import BACKENDS, ExpertHooks, routed_experts

__all__ = ["BACKENDS", "ExpertHooks", "routed_experts"]
