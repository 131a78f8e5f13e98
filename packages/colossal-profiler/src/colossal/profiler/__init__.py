"""In-iteration profiling of communication, memory and compute."""

__all__: list[str] = []
