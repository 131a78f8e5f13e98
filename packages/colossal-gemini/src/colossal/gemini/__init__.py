"""Chunk-based heterogeneous CPU/GPU memory manager."""

__all__: list[str] = []
