"""A user's own modules keep their meaning under every schedule (issue 30): a ``Linear`` subclass
that masks its weight and a ``weight_norm`` Linear under zero-bubble's split backward, a parameter
and a buffer registered after the blocks but read by the model's own output step, a parameter no
forward reads; all against single-process PyTorch (fp32, ``pp_testing.TOL``). Plus the setup
refusals: a forward a stage cannot reproduce, and meta tensors nothing initialises."""

import copy

import pytest
import torch
import torch.nn.functional as F
from pp_testing import TOL, reference, rel_err
from torch import nn

from colossal.comm.testing import run_distributed
from colossal.pipeline import PipelineConfig, PipelineParallel, WeightGradStore, split_forward
from colossal.pipeline.stages import split_model, tensor_owners

V, H, T, B, N = 16, 8, 4, 8, 8


class MaskedLinear(nn.Linear):
    """Its own forward: a fixed sparsity mask on the weight."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__(i, o)
        self.register_buffer("mask", (torch.arange(o * i).reshape(o, i) % 3 != 0).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.mask, self.bias)


class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.masked = MaskedLinear(H, H)
        self.normed = torch.nn.utils.parametrizations.weight_norm(nn.Linear(H, H))
        self.plain = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.plain(torch.tanh(self.normed(torch.tanh(self.masked(x)))))


class UserNet(nn.Module):
    """Own names; ``gain``/``shift`` registered on the model itself, after the blocks, read only by
    its own output step; ``unused`` read by nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Embedding(V, H)
        self.layers = nn.ModuleList(Blk() for _ in range(N))
        self.norm = nn.LayerNorm(H)
        self.readout = nn.Linear(H, V)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, V))
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, V))
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.stem(idx)
        for layer in self.layers:
            x = layer(x)
        return self.readout(self.norm(x)) * self.gain + self.shift


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _reference(model, seeds):
    return reference(model, seeds, _batch, _loss)


def test_split_backward_keeps_the_users_linear_forward():
    """Only plain ``nn.Linear`` layers are split; the masked subclass and the weight_norm layer keep
    their own forward (named in ``kept``) and all gradients equal plain backward."""
    torch.manual_seed(0)
    ref = UserNet()
    model = copy.deepcopy(ref)
    store = WeightGradStore()
    assert store.patch(model) == N + 1  # each block's ``plain`` and the readout
    assert store.kept == [f"layers.{i}.{k}" for i in range(N) for k in ("masked", "normed")]
    x, y = _batch(0)
    _loss(ref(x), y).backward()
    with store.capture("mb0"):
        _loss(model(x), y).backward()
    assert model.layers[0].plain.weight.grad is None  # deferred
    assert model.layers[0].normed.parametrizations.weight.original1.grad is not None  # its own autograd
    store.flush("mb0")
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert (a.grad is None) == (b.grad is None), n
        if b.grad is not None:
            assert rel_err(a.grad, b.grad) <= 1e-6, n


def test_the_forward_is_cut_at_the_blocks():
    """Each part of the model's own forward, and the tensors it reads, wherever they are registered."""
    torch.manual_seed(0)
    model = UserNet()
    cut = split_forward(model, "layers", N)
    assert cut.problem is None
    assert cut.embed_tensors == {"stem.weight"}
    assert cut.head_tensors == {"norm.weight", "norm.bias", "readout.weight", "readout.bias", "gain", "shift"}
    x, _ = _batch(0)
    h = cut.embed(model, x)
    torch.testing.assert_close(h, model.stem(x), rtol=0, atol=0)
    for layer in model.layers:
        h = layer(h)
    torch.testing.assert_close(cut.head(model, h), model(x), rtol=0, atol=0)
    owners = tensor_owners(model, "layers")
    assert owners["gain"] == owners["shift"] == ("last", -1) and owners["stem.weight"] == ("first", -1)
    assert owners["unused"] == ("first", -1)  # read by nothing: by its module's order (the model's own: first)


class _UsesInputAfter(UserNet):
    def forward(self, idx):
        x = self.stem(idx)
        for layer in self.layers:
            x = layer(x)
        return self.readout(x) + idx.unsqueeze(-1)  # the input itself after the blocks


class _ReadsBothSides(UserNet):
    def forward(self, idx):
        x = self.stem(idx) * self.gain[:H]
        for layer in self.layers:
            x = layer(x)
        return self.readout(x) * self.gain


class _Untraceable(UserNet):
    def forward(self, idx):
        x = self.stem(idx)
        if x.sum() > 0:  # data-dependent: torch.fx cannot trace it
            x = -x
        for layer in self.layers:
            x = layer(x)
        return self.readout(self.norm(x)) * self.gain


class _UntraceablePlain(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.layers, self.readout = (
            nn.Embedding(V, H),
            nn.ModuleList(Blk() for _ in range(2)),
            nn.Linear(H, V),
        )

    def forward(self, idx):
        x = self.stem(idx)
        if x.numel() == 0:
            return x
        for layer in self.layers:
            x = layer(x)
        return self.readout(x)


class _ResidualOutside(_UntraceablePlain):
    def forward(self, idx):
        x = self.stem(idx)
        for layer in self.layers:
            x = x + layer(x)  # the children-order fallback would drop this residual
        return self.readout(x)


def test_a_forward_a_stage_cannot_reproduce_is_refused_at_setup():
    bounds = [(0, N // 2), (N // 2, N)]
    with pytest.raises(ValueError, match=r"computes layers.1's input from more than.*move that code into the block"):
        split_model(_ResidualOutside(), [0], [(0, 1), (1, 2)], blocks="layers")
    with pytest.raises(ValueError, match=r"uses 'idx' after the blocks.*pass head=fn\(model, x\)"):
        split_model(_UsesInputAfter(), [1], bounds, blocks="layers", embed=lambda m, x: x)
    with pytest.raises(NotImplementedError, match="reads gain both before and after the blocks"):
        split_model(_ReadsBothSides(), [0], bounds, blocks="layers")
    with pytest.raises(ValueError, match=r"registers \['gain', 'unused', 'shift'\] on the model itself.*torch.fx"):
        split_model(_Untraceable(), [0], bounds, blocks="layers")
    # an untraceable forward without tensors of its own: the children in registration order, as before
    torch.manual_seed(0)
    model = _UntraceablePlain()
    first, last = split_model(model, [0, 1], [(0, 1), (1, 2)], blocks="layers")
    x, _ = _batch(0)
    torch.testing.assert_close(last(first(x)), model(x), rtol=0, atol=0)


def _rank(schedules):
    p = torch.distributed.get_world_size()
    torch.manual_seed(0)
    ref = UserNet()
    expect = _reference(copy.deepcopy(ref), [1, 2])
    for sched, v in schedules:
        cfg = PipelineConfig(num_microbatches=4, schedule=sched, virtual=v)
        pipe = PipelineParallel(copy.deepcopy(ref), cfg)  # no embed=/head=: the model's own forward
        if sched == "zero_bubble":
            assert pipe.weight_store.kept and all(".masked" in n or ".normed" in n for n in pipe.weight_store.kept)
        for s, (ref_loss, ref_grads) in zip([1, 2], expect):
            for q in pipe.parameters():
                q.grad = None
            loss = pipe.step(*_batch(s), _loss).item()
            assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (sched, p, loss, ref_loss)
            for n, q in pipe.named_parameters():
                if ref_grads[n] is None:
                    assert q.grad is None, (sched, n)
                else:
                    assert rel_err(q.grad, ref_grads[n]) <= TOL, (sched, p, n, rel_err(q.grad, ref_grads[n]))
        mine = set(pipe.state_dict())
        assert ({"gain", "shift"} <= mine) == (torch.distributed.get_rank() == p - 1), mine
    with torch.device("meta"):
        meta = UserNet()
    try:
        PipelineParallel(meta, PipelineConfig(num_microbatches=2))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world", [2, 4])
def test_user_modules_under_every_schedule_match_single_process(world):
    schedules = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)]
    msgs = run_distributed(_rank, world, schedules, timeout=240)
    assert msgs[0] and msgs == [msgs[0]] * world  # the meta refusal: on every rank alike, before any transfer
    named = msgs[0].split(" would not be initialised")[0].removeprefix("meta-device model: ").split(", ")
    assert sorted(named) == sorted(
        ["gain", "unused", "shift"]
        + [f"layers.{i}.normed.parametrizations.weight.original{j}" for i in range(N) for j in (0, 1)]
    )
