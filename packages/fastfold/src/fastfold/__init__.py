"""AlphaFold-2 Evoformer with dynamic axial parallelism and chunked inference."""

__all__: list[str] = []
