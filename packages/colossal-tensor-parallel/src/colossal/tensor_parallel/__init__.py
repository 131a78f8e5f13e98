"""1D/2D/2.5D/3D tensor parallelism and sequence parallelism."""

__all__: list[str] = []
