"""The chunk size chosen from the memory the user allows (``EvoformerStack(..., max_memory=)``).

[Note: choosing the chunk size]
Chunks trade memory for speed: every operator's intermediates scale with the rows of one chunk,
and larger chunks run fewer, larger kernels (faster). So the fastest chunk size that fits is the
largest one, and the chooser takes the largest of ``None`` (unchunked), ``R``, ``R/2``, ... ``1``
whose estimated activation peak fits ``max_memory``. The estimate is the model of this package's
operators (not a measurement): a fixed part (the residual streams an update is added into, the
in-place clones, the triangle-update operands ``a_t``/``b_t``, the outer-product intermediates
that do not shrink with the chunk) plus the largest per-chunk working set over the operators
(attention projections, a merged mask when keys are masked, transition hidden layers, the
triangle-update combine), all times a safety factor for allocator slack. The test measures the
peak (RSS high-water mark of a fresh process) against ``max_memory``.
"""

from __future__ import annotations

from fastfold.config import EvoformerConfig

__all__ = ["estimate_activation_bytes", "choose_chunk_size"]

_SAFETY = 1.1
_SLACK = 4 * 2**20  # allocator and interpreter noise


def _per_row(cfg: EvoformerConfig, n_seq: int, n_res: int, masked: bool) -> dict[str, tuple[int, int]]:
    """Per operator: (rows of its chunked axis, float elements of its working set per row)."""
    r, s, c_z, c_m = n_res, n_seq, cfg.c_z, cfg.c_m
    hd_pair, hd_msa = cfg.no_heads_pair * cfg.c_hidden_pair_att, cfg.no_heads_msa * cfg.c_hidden_msa_att
    c_mul, c_opm = cfg.c_hidden_mul, cfg.c_hidden_opm
    return {
        # LN, q, k, v, g, o of one row (+ the merged mask of its logits when keys are masked)
        "msa_row": (s, r * (5 * hd_msa + 2 * c_m) + masked * cfg.no_heads_msa * r * r),
        "msa_col": (r, s * (5 * hd_msa + 2 * c_m) + masked * cfg.no_heads_msa * s * s),
        "msa_transition": (s, r * (2 * cfg.transition_n * c_m + 2 * c_m)),
        # b-first form: bw [S, J_c, c_z, c] and its permuted copy, the output rows; else [I_c, J, c*c]
        "opm": (r, max(2 * s * c_z * c_opm + 2 * r * c_z, r * c_opm * c_opm + 2 * r * c_z)),
        "tri_mul_project": (r, r * (c_z + 4 * c_mul)),
        "tri_mul_combine": (r, r * (3 * c_mul + 3 * c_z)),
        "tri_att": (r, r * (5 * hd_pair + 2 * c_z) + masked * cfg.no_heads_pair * r * r),
        "pair_transition": (r, r * (2 * cfg.transition_n * c_z + 2 * c_z)),
    }


def estimate_activation_bytes(
    cfg: EvoformerConfig,
    n_seq: int,
    n_res: int,
    chunk_size: int | None,
    inplace: bool,
    masked: bool = True,
    itemsize: int = 4,
) -> int:
    """Estimated activation peak (bytes above the inputs and weights) of an inference forward of
    :class:`~fastfold.EvoformerStack` with ``cfg`` on [n_seq, n_res] inputs (see
    [Note: choosing the chunk size]); ``masked``: some keys are masked (adds merged masks)."""
    z, m = n_res * n_res * cfg.c_z, n_seq * n_res * cfg.c_m
    operands = 2 * n_res * n_res * cfg.c_hidden_mul  # the triangle update's A and B
    fixed = (z + m) if inplace else 3 * (z + m)  # clones, or old stream + update + new stream
    fixed += operands + cfg.no_heads_pair * n_res * n_res * 2  # + the pair bias (and its copy)
    chunked = max(min(chunk_size or rows, rows) * per for rows, per in _per_row(cfg, n_seq, n_res, masked).values())
    return int(_SAFETY * (fixed + chunked) * itemsize) + _SLACK


def choose_chunk_size(
    cfg: EvoformerConfig, n_seq: int, n_res: int, max_memory: int, inplace: bool, masked: bool = True
) -> int | None:
    """The largest chunk size (``None``: unchunked first) whose estimated activation peak fits
    ``max_memory`` bytes; ``ValueError`` ("need X, have Y") when not even chunk size 1 fits."""
    if not isinstance(max_memory, int) or isinstance(max_memory, bool) or max_memory <= 0:
        raise ValueError(f"max_memory must be a positive number of bytes, got {max_memory!r}")
    candidates: list[int | None] = [None]
    size = 1 << max(n_res, n_seq).bit_length()
    while size >= 1:
        candidates.append(size)
        size //= 2
    for chunk in candidates:
        if estimate_activation_bytes(cfg, n_seq, n_res, chunk, inplace, masked) <= max_memory:
            return chunk
    need = estimate_activation_bytes(cfg, n_seq, n_res, 1, inplace, masked)
    raise ValueError(
        f"max_memory too small for n_seq={n_seq}, n_res={n_res} (inplace={inplace}): "
        f"need {need / 2**20:.1f} MiB even at chunk size 1, have {max_memory / 2**20:.1f} MiB"
    )
