"""Lightning strategies that checkpoint activations before the model is wrapped, as ``FSDPStrategy`` does.

Lightning's ``FSDPStrategy`` takes ``activation_checkpointing_policy``; DDP and single-device training have no such
argument. These strategies take it, with this library's BatchNorm-correct checkpointing, a measured
``memory_budget`` and the cheap ``rebuild_bn_relu``::

    Trainer(strategy=CheckpointingDDPStrategy(activation_checkpointing_policy={Bottleneck}, memory_budget=0.6))

Use a strategy when the checkpointing belongs to how the model is trained on this hardware (it sits beside
``devices`` and ``precision`` in a config); use the :class:`~lightning_memguard.ActivationCheckpointing` callback
to keep the choice in checkpoints (a resumed run re-applies it without measuring) or beside other strategies.
"""

from lightning_memguard.strategies.checkpointing_strategies import (
    CheckpointingDDPStrategy,
    CheckpointingSingleDeviceStrategy,
)

__all__ = ["CheckpointingDDPStrategy", "CheckpointingSingleDeviceStrategy"]
