"""The chunk size chosen from ``max_memory``: the activation peak MEASURED in a fresh process (RSS
high-water mark, see fastfold.inference [Note: how memory is measured]) stays within the budget,
where the unchunked run would exceed it; a budget nothing fits is a ValueError."""

import pytest
import torch

from fastfold import EvoformerConfig, EvoformerStack
from fastfold.autochunk import choose_chunk_size
from fastfold.inference import TrunkSpec, run_trunk

MiB = 2**20
SIZES = dict(n_seq=8, n_res=128, c_m=64, c_z=32, blocks=1, threads=1, repeats=2)  # repeats: one warm-up


@pytest.mark.timeout(600)
def test_max_memory_respected_measured():
    budget = 28  # MiB; unchunked needs about twice that
    unchunked = run_trunk(TrunkSpec(**SIZES, inplace=True))[0].activation_bytes
    assert unchunked > budget * MiB, f"unchunked peak {unchunked / MiB:.1f} MiB: the budget would not bind"
    cfg = EvoformerConfig(c_m=SIZES["c_m"], c_z=SIZES["c_z"], no_blocks=1)
    chosen = choose_chunk_size(cfg, SIZES["n_seq"], SIZES["n_res"], budget * MiB, inplace=True, masked=False)
    assert chosen is not None and chosen >= 2, f"chose {chosen}"
    measured = run_trunk(TrunkSpec(**SIZES, inplace=True, max_memory_mib=budget))[0].activation_bytes
    assert measured <= budget * MiB, f"measured {measured / MiB:.1f} MiB > max_memory {budget} MiB"


def test_chooser_bounds_and_errors():
    cfg = EvoformerConfig(no_blocks=1)
    assert choose_chunk_size(cfg, 16, 64, 2**40, inplace=False) is None  # everything fits: unchunked
    sizes = [choose_chunk_size(cfg, 16, 256, b * MiB, inplace=True) for b in (200, 400, 4000)]
    assert sizes[0] <= sizes[1] and (sizes[2] is None or sizes[1] <= sizes[2]), sizes
    with pytest.raises(ValueError, match=r"need .* MiB even at chunk size 1, have 1.0 MiB"):
        choose_chunk_size(cfg, 16, 256, MiB, inplace=True)
    with pytest.raises(ValueError, match="max_memory must be a positive"):
        choose_chunk_size(cfg, 16, 256, -1, inplace=True)
    model = EvoformerStack(EvoformerConfig(c_m=8, c_z=8, no_blocks=1)).eval()
    with pytest.raises(ValueError, match="chunk_size or max_memory, not both"), torch.no_grad():
        model(torch.zeros(2, 4, 8), torch.zeros(4, 4, 8), chunk_size=2, max_memory=2**30)
