"""Vision styles on a user's own model (no ``transformers``), 2D on 4 ranks: ``PATCH_EMBED`` (a
``Conv2d`` patch projection), ``VISION_EMBED`` (an embedding module cutting the images to the batch
block, with its own class token and positions) and ``GATHER`` (a replicated classifier on the
gathered class tokens). The logits (whole on every rank) and the gradients of every piece equal
the dense model's (fp32, ``assert_close``'s 1e-5 relative: the same sums in another order).
Shapes that do not split raise ``ValueError`` naming them, before the model is touched."""

import copy

import pytest
import torch
from torch import nn

from colossal.comm import Mesh
from colossal.comm.testing import run_distributed
from colossal.tensor_parallel import Grid2D, Style, gpt_plan, hidden_layout_2d, parallelize
from colossal.testkit import Block, GPTConfig, assert_close

C, IMG, P, CLASSES = 16, 8, 4, 3
T = (IMG // P) ** 2 + 1


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Conv2d(3, C, P, P)
        self.cls = nn.Parameter(torch.randn(1, 1, C))
        self.pos = nn.Parameter(torch.randn(1, T, C))

    def forward(self, images):
        x = self.proj(images).flatten(2).transpose(1, 2)  # (b, T-1, C/q)
        return torch.cat((self.cls.expand(images.shape[0], -1, -1), x), 1) + self.pos


class TinyViT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.block, self.norm = Embed(), Block(GPTConfig(n_embd=C, n_head=4)), nn.LayerNorm(C)
        self.head = nn.Linear(C, CLASSES)

    def forward(self, images):
        return self.head(self.norm(self.block(self.embed(images)))[:, 0])


class ConvOnly(nn.Module):
    """The conv is the model's entry (it cuts the batch itself)."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Conv2d(3, C, P, P), nn.Linear(C, CLASSES)

    def forward(self, images):
        return self.head(self.proj(images).flatten(2).transpose(1, 2)[:, 0])


PLAN = {
    "embed": Style.VISION_EMBED,
    "embed.proj": Style.PATCH_EMBED,
    **{k.replace("blocks.*", "block"): v for k, v in gpt_plan("2d").items() if k.startswith("blocks.*")},
    "norm": Style.NORM,
    "head": Style.GATHER,
}


def _parity(dense, plan, mesh, layout, pieces):
    images, labels = torch.randn(8, 3, IMG, IMG), torch.randint(0, CLASSES, (8,))
    par = parallelize(copy.deepcopy(dense), "2d", mesh, plan)
    nn.functional.cross_entropy(dense(images), labels).backward()
    logits = par(images)  # whole on every rank
    nn.functional.cross_entropy(logits, labels).backward()
    assert_close(logits, dense(images), "logits")
    for name, dim in pieces.items():
        want = layout.shard(dense.get_parameter(name).grad, dim)
        assert_close(par.get_parameter(name).grad, want, f"grad {name}")
    assert_close(par.head.weight.grad, dense.head.weight.grad, "replicated head grad")


def _run():
    torch.manual_seed(0)
    mesh = Mesh(axes={"tp": 4})
    layout = hidden_layout_2d(Grid2D.of(mesh.layout("2d", "tp")))
    pieces = {"embed.proj.weight": 0, "embed.proj.bias": 0, "embed.cls": -1, "embed.pos": -1}
    _parity(TinyViT(), PLAN, mesh, layout, pieces)
    _parity(ConvOnly(), {"proj": Style.PATCH_EMBED, "head": Style.GATHER}, mesh, layout, {"proj.weight": 0})
    dense = TinyViT()
    with pytest.raises(ValueError, match=r"batch \(images\) size 5 must be divisible by 2"):
        parallelize(copy.deepcopy(dense), "2d", mesh, PLAN)(torch.randn(5, 3, IMG, IMG))
    bad = TinyViT()
    bad.embed.pos = nn.Parameter(torch.randn(1, T, 18))
    with pytest.raises(ValueError, match=r"Embed.pos.shape\[-1\] \(hidden size\)=18 must be divisible by the 2d"):
        parallelize(bad, "2d", mesh, PLAN)
    assert bad.embed.pos.shape == (1, T, 18)  # untouched


def test_vision_styles_2d_match_dense():
    run_distributed(_run, 4, timeout=180)
