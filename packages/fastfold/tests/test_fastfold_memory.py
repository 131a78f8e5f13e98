"""``fastfold.memory`` on CUDA paths, with ``torch.cuda`` monkeypatched (no GPU needed): the peak
is read on the model's device and no library call resets a caller's peak."""

import pytest
import torch
from fastfold_testutils import rand, tiny_evo

from fastfold import EvoformerStack, memory
from fastfold.inference import run_evoformer


class FakeCuda:
    """Records which device index each ``torch.cuda`` statistic was asked for."""

    def __init__(self, monkeypatch, current=0, peaks=None):
        self.calls, self.resets, self.current = [], [], current
        self.peaks = dict(peaks or {})
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", self.max_memory_allocated)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: self.resets.append(device))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def max_memory_allocated(self, device=None):
        index = self.current if device is None else device
        self.calls.append(index)
        return self.peaks.get(index, 0)


class OnCuda1(torch.nn.Module):
    """Looks like a model on ``cuda:1`` (its parameters report that device)."""

    def parameters(self, recurse=True):
        class P:
            device = torch.device("cuda", 1)

        yield P()


def test_peak_device_bytes_reads_model_device(monkeypatch):
    cuda = FakeCuda(monkeypatch, current=0, peaks={0: 10, 1: 77})
    assert memory.peak_device_bytes(OnCuda1()) == 77
    assert cuda.calls == [1]
    assert memory.peak_device_bytes(torch.device("cuda:1")) == 77
    assert memory.peak_device_bytes() == 10  # no model: the current device, as before
    assert memory.peak_device_bytes(torch.nn.Linear(2, 2)) == 0  # a CPU model has no device peak
    memory.reset_peak_memory(OnCuda1())
    assert cuda.resets == [1]


def test_device_peak_during_never_resets(monkeypatch):
    cuda = FakeCuda(monkeypatch, current=0, peaks={1: 100})
    with memory.device_peak_during(OnCuda1()) as m:
        cuda.peaks[1] = 150  # the block raised the mark: its peak is known
    assert (m.prior_peak_bytes, m.peak_bytes) == (100, 150)
    with memory.device_peak_during(OnCuda1()) as m:
        pass  # below the caller's earlier peak: not resolvable without a reset
    assert m.peak_bytes is None and m.prior_peak_bytes == 150
    assert cuda.resets == [] and set(cuda.calls) == {1}
    with pytest.raises(TypeError, match="int"):
        memory.device_of(3)


def test_run_evoformer_keeps_callers_cuda_peak(monkeypatch):
    torch.manual_seed(0)
    model = EvoformerStack(tiny_evo()).double().eval()
    m, z = rand(3, 6, 12), rand(6, 6, 8)
    cuda = FakeCuda(monkeypatch)
    run_evoformer(model, m, z)
    assert cuda.resets == []
