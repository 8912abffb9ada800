"""The routed-expert contract (ExpertSpec: parameters, gated activation, biases) and the activation table."""

from moelens.experts.spec import GLU, ClampedSwiGLU, ExpertSpec, ExpertTensors, GatedActivation

__all__ = ["ClampedSwiGLU", "ExpertSpec", "ExpertTensors", "GLU", "GatedActivation"]
