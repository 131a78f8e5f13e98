"""LAMB, LARS, CPU/Hybrid Adam, dynamic loss scaler and sharded gradient clipping."""

__all__: list[str] = []
