"""The routed-expert contract (ExpertSpec: parameters, gated activation, biases, storage), stored experts
(StoredExperts: kept as the checkpoint stores them) and the activation table."""

from moelens.experts.spec import GLU, ClampedSwiGLU, ExpertSpec, ExpertTensors, GatedActivation
from moelens.experts.stored import StoredExperts, StoredPart

__all__ = ["ClampedSwiGLU", "ExpertSpec", "ExpertTensors", "GLU", "GatedActivation", "StoredExperts", "StoredPart"]
