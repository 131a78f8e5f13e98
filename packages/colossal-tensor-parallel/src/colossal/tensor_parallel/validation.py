"""Shape checks run identically on every rank *before* any collective, so a bad shape raises the
same ``ValueError`` everywhere instead of hanging a group."""

from __future__ import annotations

__all__ = ["check_divisible", "grid_side"]


def check_divisible(value: int, by: int, what: str, by_what: str) -> None:
    """Raise ``ValueError`` unless ``value`` (named ``what``) is divisible by ``by`` (named ``by_what``)."""
    if by < 1 or value % by:
        raise ValueError(f"{what}={value} must be divisible by {by_what}={by} (remainder {value % max(by, 1)})")


def grid_side(world: int, power: int, mode: str, depth: int = 1) -> int:
    """The side ``q`` with ``q**power * depth == world``, or a ``ValueError`` naming the sizes."""
    if depth < 1:
        raise ValueError(f"{mode}: depth must be >= 1, got {depth}")
    q = round((world / depth) ** (1 / power)) if world % depth == 0 else 0
    if q < 1 or q**power * depth != world:
        need = {2: "q^2", 3: "q^3"}[power] + ("*d" if mode == "2.5d" else "")
        raise ValueError(f"{mode} tensor parallel needs a group size of {need}; got {world} (depth d={depth})")
    return q
