"""Token mixers other than softmax attention (which lives in moelens.models.components), behind one protocol
(moelens.models.mixers.base.Mixer)."""
