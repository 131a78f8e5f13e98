"""Hugging Face ``ViTForImageClassification`` under the hybrid plugin's built-in ViT policy in the
modes that split the activations: 2D (tp 4), 2.5D (tp 8, depth 2) and 3D (tp 8). The policy converts
the ``Conv2d`` patch projection (``Style.PATCH_EMBED``), the embeddings' ``cls_token`` and
``position_embeddings`` (``Style.VISION_EMBED``), the LayerNorms, the attention and MLP linears,
and gathers the CLS tokens before the replicated classifier (``Style.GATHER``).

Each mode trains the tiny ViT of ``hf_models`` (hidden 32, 4 heads, 16x16 images in 4x4 patches,
random weights, nothing downloaded) 3 steps with AdamW against plain PyTorch. Tolerance: fp32,
1e-5 relative on the per-step losses (the same sums in another order: blockwise matmuls,
LayerNorm statistics summed over hidden blocks; measured differences are 1-2 ulp). The trained
weights, gathered into the Hugging Face state dict (names, dense shapes), match to 1e-5 absolute
(lr 1e-2: a thousandth of one step; measured at most 2.7e-6) in all but 0.5% of each tensor's
elements, and every element to 1e-3 (a tenth of one step): Adam divides each gradient by its own
magnitude, so an element whose gradient is tiny turns reduction-order rounding into a visible
step (one element of 1024 in ``v_proj.weight`` moved 2.5e-5 apart on another machine). A wrong
gradient moves whole rows by up to a step. ``attention.k_proj.bias`` is left out of that check:
its exact gradient is zero (softmax ignores a score added to every key), so both runs step it by
Adam-normalised rounding noise.
"""

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_models import batches, build, loss  # noqa: E402
from plan_harness import LR, boosted_losses, dense_losses  # noqa: E402

from colossal.comm.testing import run_distributed  # noqa: E402
from colossalai import HybridParallelPlugin  # noqa: E402
from colossalai.booster.hybrid.plans import model_plan  # noqa: E402


def _dense_state() -> dict:
    torch.manual_seed(0)
    model = build("vit")
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    for batch in batches("vit"):
        loss(model, batch).backward()
        optim.step()
        optim.zero_grad()
    return model.state_dict()


def _train(mode: str, tp: int, depth: int):
    plugin = HybridParallelPlugin(tp_size=tp, tp_mode=mode, tp_depth=depth)
    holder = {}

    def build_and_keep():
        holder["model"] = build("vit")
        return holder["model"]

    losses = boosted_losses(plugin, build_and_keep, batches("vit"), loss)
    return losses, plugin.full_model_state_dict(holder["model"])


def _train_modes(modes: list[tuple[str, int]]) -> dict:
    """Every ``(mode, depth)`` in one spawn (8-rank spawns are the slow part of these tests)."""
    return {mode: _train(mode, dist.get_world_size(), depth) for mode, depth in modes}


@pytest.mark.parametrize(("world", "modes"), [(4, [("2d", 1)]), (8, [("2.5d", 2), ("3d", 1)])], ids=["2d", "2.5d+3d"])
def test_vit_grid_modes_train_like_plain_pytorch(world, modes):
    want = torch.tensor(dense_losses(lambda: build("vit"), batches("vit"), loss))
    state = _dense_state()
    for results in run_distributed(_train_modes, world, modes, timeout=300):
        for mode, (losses, got) in results.items():
            torch.testing.assert_close(torch.tensor(losses), want, rtol=1e-5, atol=0, msg=lambda m, k=mode: f"{k}: {m}")
            assert list(got) == list(state)  # the Hugging Face names, in order
            for name, want_t in state.items():
                assert got[name].shape == want_t.shape, name
                if not name.endswith("attention.k_proj.bias"):  # a zero gradient: see the module docstring
                    diff = (got[name] - want_t).abs()
                    off = int((diff > 1e-5 + 1e-5 * want_t.abs()).sum())
                    assert off <= 0.005 * diff.numel() and float(diff.max()) < 1e-3, (mode, name, off, diff.max())


def test_vit_grid_shapes_that_do_not_split_raise_before_any_collective():
    torch.manual_seed(0)
    model = build("vit")  # hidden 32, 4 heads, MLP 64
    sizes = dict(sp_size=1, sp_kind="ring", pp_size=1)
    with pytest.raises(ValueError, match=r"hidden_size=32 must be divisible by q\^3=64 \(q=4\)"):
        model_plan(model, None, tp_size=64, tp_mode="3d", **sizes)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 must be divisible by the grid side q=8"):
        model_plan(model, None, tp_size=64, tp_mode="2d", **sizes)  # heads are checked first
    with pytest.raises(NotImplementedError, match="compose with dp only"):
        model_plan(model, None, tp_size=4, tp_mode="2d", sp_size=2, sp_kind="ring", pp_size=1)
