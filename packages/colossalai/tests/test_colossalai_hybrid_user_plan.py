"""``HybridParallelPlugin(plan=...)`` on a user's own model whose modules are named nothing like
the GPT's (``mixer.wq``, ``ffn.0``), against the same model trained by plain PyTorch; the plan is
checked up front (patterns that match nothing, the modules that exist); a model without a plan
trains with ``tp_size=1`` and is refused with ``tp_size > 1``; an attention module that cannot
become sequence-parallel attention is refused, naming the attributes it lacks.

Tolerance: fp32, 1e-5 relative per-step loss (tensor parallelism only reorders sums).
"""

import pytest
import torch
import torch.nn.functional as F
from plan_harness import boosted_losses, dense_losses, errors_on_every_rank
from torch import nn

from colossal.comm.testing import run_distributed
from colossal.tensor_parallel import Style
from colossalai import Booster, HybridParallelPlugin

V, D, H, T, B = 64, 32, 4, 8, 8


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_head = H  # divided by the tp size (Style.HEADS)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.n_head, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.mixer = Mixer()
        self.ffn = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.out_norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.out_norm(x))


PLAN = {
    "embed": Style.VOCAB_EMBED,
    "layers.*.norm[12]": Style.NORM,
    "layers.*.mixer": Style.HEADS,
    "layers.*.mixer.w[qkv]": Style.COL,
    "layers.*.mixer.wo": Style.ROW,
    "layers.*.ffn.0": Style.COL,
    "layers.*.ffn.2": Style.ROW,
    "out_norm": Style.NORM,
    "head": Style.LM_HEAD,
}


def _batches():
    g = torch.Generator().manual_seed(1)
    return [{"ids": torch.randint(0, V, (B, T + 1), generator=g)} for _ in range(3)]


def _lm_loss(model, batch):
    ids = batch["ids"]
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def _sequential():
    return nn.Sequential(nn.Embedding(V, D), nn.Linear(D, V))


class _Spare(nn.Module):
    """A user model with a parameter its forward never uses."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.spare = nn.Parameter(torch.ones(3))

    def forward(self, ids):
        return self.head(self.embed(ids))


def _seq_loss(model, batch):
    ids = batch["ids"]
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def _boost(plugin, build):
    torch.manual_seed(0)
    model = build()
    return Booster(plugin=plugin).boost(model, torch.optim.AdamW(model.parameters()))


def _world2():
    return {
        "tp2": boosted_losses(HybridParallelPlugin(tp_size=2, plan=PLAN), TinyLM, _batches(), _lm_loss),
        "sequential_tp1": boosted_losses(HybridParallelPlugin(tp_size=1), _sequential, _batches(), _seq_loss),
        # dp 2 (DDP) over a model with an unused parameter, as TorchDDPPlugin(find_unused_parameters=True)
        "unused_dp2": boosted_losses(
            HybridParallelPlugin(tp_size=1, find_unused_parameters=True), _Spare, _batches(), _seq_loss
        ),
        "unused_flag": errors_on_every_rank(lambda: HybridParallelPlugin(find_unused_parameters="yes")),
        "no_plan": errors_on_every_rank(lambda: _boost(HybridParallelPlugin(tp_size=2), TinyLM)),
        "bad_plan": errors_on_every_rank(
            lambda: _boost(HybridParallelPlugin(tp_size=2, plan={**PLAN, "blocks.*.attn": Style.HEADS}), TinyLM)
        ),
        # sequence parallelism never guesses: Mixer's projections are wq/wk/wv/wo, not q_proj/...
        "sp_unconvertible": errors_on_every_rank(
            lambda: _boost(HybridParallelPlugin(tp_size=1, sp_size=2, plan={"layers.*.mixer": Style.ATTENTION}), TinyLM)
        ),
    }


def _world4():
    return boosted_losses(HybridParallelPlugin(tp_size=2, plan=PLAN), TinyLM, _batches(), _lm_loss)


def test_user_plan_trains_like_plain_pytorch_and_bad_plans_fail_up_front():
    ref = torch.tensor(dense_losses(TinyLM, _batches(), _lm_loss))
    ref_seq = torch.tensor(dense_losses(_sequential, _batches(), _seq_loss))
    ref_spare = torch.tensor(dense_losses(_Spare, _batches(), _seq_loss))
    for got in run_distributed(_world2, 2, timeout=120):
        torch.testing.assert_close(torch.tensor(got["tp2"]), ref, rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(got["sequential_tp1"]), ref_seq, rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(got["unused_dp2"]), ref_spare, rtol=1e-5, atol=0)
        assert "find_unused_parameters must be a bool, got 'yes'" in got["unused_flag"]
        assert "pass plan=" in got["no_plan"] and "layers.*.mixer.wq" in got["no_plan"], got["no_plan"]
        assert "['blocks.*.attn'] match no module" in got["bad_plan"], got["bad_plan"]
        assert "layers.*.ffn.0" in got["bad_plan"], got["bad_plan"]
        assert "Mixer cannot become sequence-parallel attention" in got["sp_unconvertible"], got["sp_unconvertible"]
        assert "'q_proj', 'k_proj', 'v_proj', 'out_proj', 'is_causal (bool)'" in got["sp_unconvertible"]


def test_user_plan_tp_x_dp_on_four_ranks():
    ref = torch.tensor(dense_losses(TinyLM, _batches(), _lm_loss))
    for got in run_distributed(_world4, 4, timeout=120):
        torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-5, atol=0)


def test_plan_must_be_a_dict_of_styles():
    with pytest.raises(TypeError, match="plan must be a non-empty dict"):
        HybridParallelPlugin(plan=[("a", "col")])
    with pytest.raises(ValueError, match="'sideways' is not a Style"):
        HybridParallelPlugin(plan={"a": "sideways"})
