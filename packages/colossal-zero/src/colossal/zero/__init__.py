"""ZeRO stages 1-3 with static CPU offload and reshardable checkpoints."""

__all__: list[str] = []
