"""``colossal.comm.memory``: the one reader of the process's RSS (now and peak), against the
kernel's own ``/proc/self/status`` parsed independently, and the peak reset."""

import pathlib
import sys

import pytest
import torch

from colossal.comm.memory import reset_peak_rss, rss_and_peak_bytes

linux = pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="needs /proc")


def _kernel(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


@linux
def test_reads_what_the_kernel_reports():
    rss, peak = rss_and_peak_bytes()
    assert abs(rss - _kernel("VmRSS")) < 8 << 20  # the two reads are moments apart
    assert peak >= rss and abs(peak - _kernel("VmHWM")) < 8 << 20


@linux
def test_the_peak_follows_a_large_buffer_and_resets():
    _, before = rss_and_peak_bytes()
    buf = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    rss, peak = rss_and_peak_bytes()
    assert peak >= before and peak >= rss >= 64 << 20
    del buf
    if not reset_peak_rss():
        pytest.skip("clear_refs is not writable here")
    rss, peak = rss_and_peak_bytes()
    assert peak - rss < 16 << 20  # the high-water mark is back near the current size


def test_without_proc_the_peak_falls_back_to_getrusage(monkeypatch):
    import os

    def no_proc(path, flags):
        raise FileNotFoundError(path)

    monkeypatch.setattr(os, "open", no_proc)
    rss, peak = rss_and_peak_bytes()
    assert rss is None
    assert peak is None if sys.platform == "win32" else peak > 0
