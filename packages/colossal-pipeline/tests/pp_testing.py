"""Shared helpers of this package's tests: a tiny GPT, its pipeline parts, parity checks."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from colossal.pipeline import PipelineConfig, PipelineParallel

TOL = 1e-5
"""fp32 parity: the pipeline computes the same products per micro-batch and sums micro-batch
gradients in ``.grad`` instead of inside one batched matmul, so results differ from the
single-process step by a few ulps; 1e-5 of each tensor's norm is far above that and far below
any real bug (a missing micro-batch is a 1/m error)."""

V, T, H, N_BLOCKS, BATCH = 32, 8, 16, 8, 8


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, h: int = H, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """Token + position embedding, blocks, final norm, LM head (optionally tied to the embedding)."""

    def __init__(self, n_blocks: int = N_BLOCKS, tied: bool = False, sizes: list[int] | None = None) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, H), nn.Embedding(T, H)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(H)
        self.lm_head = nn.Linear(H, V, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return gpt_head(self, run_blocks(self, gpt_embed(self, idx)))


def gpt_embed(model: TinyGPT, idx: torch.Tensor) -> torch.Tensor:
    """(B, T) ids -> (B, T, H)."""
    return model.wte(idx) + model.wpe(torch.arange(idx.shape[1], device=idx.device))


def gpt_head(model: TinyGPT, x: torch.Tensor) -> torch.Tensor:
    """(B, T, H) -> (B, T, V) logits."""
    return model.lm_head(model.ln_f(x))


def run_blocks(model: TinyGPT, x: torch.Tensor) -> torch.Tensor:
    for blk in model.blocks:
        x = blk(x)
    return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(seed: int, b: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (b, T), generator=g), torch.randint(0, V, (b, T), generator=g)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def reference(
    model: nn.Module, seeds: list[int], batch_fn=None, loss_fn=None
) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Single-process loss and gradients (by every name, tied ones under each) of each batch
    (``batch_fn(seed)``, default :func:`batch`; ``loss_fn``, default :func:`lm_loss`)."""
    batch_fn, loss_fn, out = batch_fn or batch, loss_fn or lm_loss, []
    for s in seeds:
        model.zero_grad(set_to_none=True)
        idx, tgt = batch_fn(s)
        loss = loss_fn(model(idx), tgt)
        loss.backward()
        grads = {
            n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)
        }
        out.append((loss.item(), grads))
    return out


def check_pipeline(cfg: PipelineConfig, tied: bool, seeds=(1, 2), meta: bool = True, **kw) -> PipelineParallel:
    """Build the pipeline from a meta-device model loaded with the reference weights, run one step
    per seed, and assert loss and every local gradient equal the single-process ones."""
    torch.manual_seed(0)
    ref = TinyGPT(tied=tied)
    sd = copy.deepcopy(ref.state_dict())
    expect = reference(ref, list(seeds))
    if meta:
        with torch.device("meta"):
            model = TinyGPT(tied=tied)
    else:
        model = copy.deepcopy(ref)
    pipe = PipelineParallel(model, cfg, embed=gpt_embed, head=gpt_head, **kw)
    pipe.load_state_dict(sd)
    for s, (ref_loss, ref_grads) in zip(seeds, expect):
        for p in pipe.parameters():
            p.grad = None
        idx, tgt = batch(s)
        loss = pipe.step(idx, tgt, lm_loss)
        assert abs(loss.item() - ref_loss) <= TOL * abs(ref_loss), f"{cfg}: loss {loss.item()} != {ref_loss}"
        names = list(dict(pipe.named_parameters()))
        assert names, "a stage with no parameters"
        for n, p in pipe.named_parameters():
            assert p.grad is not None, f"{cfg}: no gradient for {n}"
            err = rel_err(p.grad, ref_grads[n])
            assert err <= TOL, f"{cfg}: gradient of {n} off by {err:.3g}"
    return pipe
