"""The disk tier: training with most model states on disk matches plain PyTorch, stays within its host
budget, counts every byte it moves, leaves nothing behind, and checkpoints through DCP.

Tolerance: fp32 1e-5 relative (``assert_close``): the disk only stores bytes, the arithmetic is the
same element-wise AdamW as the in-memory path, so the result is bitwise the reference's on one rank;
two ranks differ from the full-batch reference by summation order only (the key bias of attention is
excluded as in ``test_gemini_dist.py``: its true gradient is zero, rounding noise decides its sign).
"""

import json
import os
import pathlib
import platform
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from colossal.comm.testing import run_distributed

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gemini_helpers import reference_gpt_run  # noqa: E402

from colossal.gemini import GeminiDDP, GeminiOptimizer, events, load_sharded, save_sharded  # noqa: E402
from colossal.gemini import disk as disk_mod  # noqa: E402
from colossal.testkit import GPT, GPTConfig, assert_close, lm_loss, random_batches  # noqa: E402

STEPS = 3
STATIC = dict(
    placement="static",
    offload_param_frac=1.0,
    disk_param_frac=0.8,
    disk_grad_frac=0.8,
    disk_optim_frac=0.8,
    device_memory_budget=1 << 20,
)
# auto: the device holds a few working chunks, the host a few more; the rest spills to disk
AUTO = dict(placement="auto", device_memory_budget=280_000, host_memory_budget=560_000)


def _gem(directory, init, **kw):
    model = GPT(GPTConfig(init="torch"))
    model.load_state_dict(init)
    gem = GeminiDDP(model, chunk_size=8192, disk_dir=str(directory), **kw)
    return gem, GeminiOptimizer(torch.optim.AdamW(gem.parameters(), lr=1e-2), gem)


def _train(gem, opt, batches, rank=0, world=1):
    for x, y in batches:
        b = x.shape[0] // world
        opt.backward(lm_loss(gem(x[rank * b : (rank + 1) * b]), y[rank * b : (rank + 1) * b]))
        opt.step()


def _io_counters() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in pathlib.Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


@pytest.mark.parametrize("kw", [STATIC, AUTO], ids=["static", "auto"])
def test_most_states_on_disk_match_pytorch_within_host_budget_and_bytes_are_counted(tmp_path, kw):
    batches = random_batches(STEPS, batch=2, seq=8)
    init, ref_state, ref_losses = reference_gpt_run(batches)
    gem, opt = _gem(tmp_path, init, **kw)
    m = gem.manager
    on_disk = sum(len(c.on_disk) for c in m.chunks)
    assert on_disk >= 0.75 * 3 * len(m.chunks), "most masters, gradients and states must live on disk"
    moves = []
    handle = events.register_observer(lambda e: moves.append(e) if e.kind == "chunk_move" else None)
    try:
        for x, y in batches:
            io0 = _io_counters()
            n0 = len(moves)
            opt.backward(lm_loss(gem(x), y))
            opt.step()
            io1 = _io_counters()
            s = gem.stats
            disk_moves = [e for e in moves[n0:] if "disk" in (e.src, e.dst) and e.reason != "io_wait"]
            # the counted disk bytes are the published moves, and what the kernel saw this process do
            assert s.disk_bytes_read == sum(e.nbytes for e in disk_moves if e.src == "disk")
            assert s.disk_bytes_written == sum(e.nbytes for e in disk_moves if e.dst == "disk")
            # reading /proc/self/io adds its own ~120 bytes to rchar, the stats' read of /proc/self/status
            # ~770 (its head: host_rss_bytes); disk I/O comes in 4 KiB pages
            assert 0 <= io1[0] - io0[0] - s.disk_bytes_read < 1024
            assert io1[1] - io0[1] == s.disk_bytes_written
            assert s.disk_bytes_read > 0 and s.disk_bytes_written > 0
    finally:
        handle.remove()
    for k, v in ref_state.items():
        assert_close(gem.state_dict()[k], v, k)
    assert m.host.peak_bytes <= m.host.budget if m.host.budget else True
    if kw is AUTO:
        assert m.host.peak_bytes <= AUTO["host_memory_budget"]
        assert any(c.w_tier == "disk" for c in m.chunks), "working shards must spill to disk"
    s = gem.stats
    assert s.belady_disk_bytes is not None and s.belady_disk_bytes <= s.disk_bytes_read + s.disk_bytes_written
    assert os.listdir(tmp_path) == []  # the scratch file is unlinked from the start


def test_buffered_fallback_without_o_direct_matches(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_mod.DiskTier, "_probe_direct", lambda self: False)
    batches = random_batches(2, batch=2, seq=8)
    init, ref_state, _ = reference_gpt_run(batches)
    gem, opt = _gem(tmp_path, init, **STATIC)
    assert not gem.manager.disk.direct
    _train(gem, opt, batches)
    for k, v in ref_state.items():
        assert_close(gem.state_dict()[k], v, k)


def _rank_train(directory, kw, batches, init):
    rank, world = dist.get_rank(), dist.get_world_size()
    gem, opt = _gem(directory, init, **kw)
    _train(gem, opt, batches, rank, world)
    return gem.state_dict(), sum(len(c.on_disk) for c in gem.manager.chunks), gem.manager.host.peak_bytes


@pytest.mark.parametrize("kw", [STATIC, AUTO], ids=["static", "auto"])
def test_two_ranks_with_states_on_disk_match_single_process(tmp_path, kw):
    batches = random_batches(STEPS, batch=2, seq=8)
    init, ref_state, _ = reference_gpt_run(batches)
    for state, on_disk, peak in run_distributed(_rank_train, 2, str(tmp_path), kw, batches, init, timeout=180):
        assert on_disk > 0
        if kw.get("host_memory_budget"):
            assert peak <= kw["host_memory_budget"]
        for k, v in ref_state.items():
            if not k.endswith("k_proj.bias"):
                assert_close(state[k], v, k)
    assert os.listdir(tmp_path) == []


def test_dcp_checkpoint_with_states_on_disk_resumes_exactly(tmp_path):
    batches = random_batches(STEPS, batch=2, seq=8)
    init, ref_state, _ = reference_gpt_run(batches)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    gem, opt = _gem(tmp_path / "a", init, **STATIC)
    _train(gem, opt, batches[:2])
    save_sharded(str(tmp_path / "ckpt"), gem, opt)
    gem2, opt2 = _gem(tmp_path / "b", init, **STATIC)  # a fresh run: nothing of the first one's disk
    load_sharded(str(tmp_path / "ckpt"), gem2, opt2)
    _train(gem2, opt2, batches[2:])
    for k, v in ref_state.items():
        assert_close(gem2.state_dict()[k], v, k)


def test_a_killed_run_leaves_nothing_on_disk(tmp_path):
    code = textwrap.dedent(
        f"""
        import os, signal, torch
        from colossal.gemini import GeminiDDP
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        gem = GeminiDDP(model, placement="static", offload_param_frac=1.0, disk_param_frac=1.0,
                        disk_grad_frac=1.0, disk_optim_frac=1.0, device_memory_budget=1 << 20,
                        chunk_size=4096, disk_dir={str(tmp_path)!r})
        assert gem.manager.disk.bytes_written > 0
        print(os.readlink(f"/proc/self/fd/{{gem.manager.disk.fd}}"), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr
    assert out.stdout.strip().endswith("(deleted)")  # the file the dead run wrote was never linked
    assert os.listdir(tmp_path) == []


def test_setup_errors(tmp_path, monkeypatch):
    model = torch.nn.Linear(64, 64)
    with pytest.raises(ValueError, match="does not exist"):
        GeminiDDP(model, device_memory_budget=1 << 20, disk_dir=str(tmp_path / "missing"), **_static_all())
    real = os.statvfs

    class _Tiny:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, 1

    monkeypatch.setattr(os, "statvfs", lambda d: _Tiny(real(d)))
    with pytest.raises(ValueError, match=rf"need \d+ bytes on {tmp_path}, free \d+"):
        GeminiDDP(model, device_memory_budget=1 << 20, disk_dir=str(tmp_path), **_static_all())
    monkeypatch.undo()
    with pytest.raises(ValueError, match="host_memory_budget"):
        GeminiDDP(model, device_memory_budget=1 << 20, disk_dir=str(tmp_path), placement="auto")
    with pytest.raises(ValueError, match="need disk_dir"):
        GeminiDDP(model, device_memory_budget=1 << 20, placement="static", disk_optim_frac=0.5)
    with pytest.raises(ValueError, match="disk_param_frac"):
        GeminiDDP(model, device_memory_budget=1 << 20, disk_dir=str(tmp_path), placement="static", disk_param_frac=1.0)
    with pytest.raises(ValueError, match="host_memory_budget=.* too small"):
        GeminiDDP(model, device_memory_budget=1 << 20, disk_dir=str(tmp_path), placement="auto", host_memory_budget=10)
    assert os.listdir(tmp_path) == []


def _static_all():
    return dict(
        placement="static", offload_param_frac=1.0, disk_param_frac=1.0, disk_grad_frac=1.0, disk_optim_frac=1.0
    )


_RSS_RUN = """
import json, os, sys, tempfile
import torch
from colossal.gemini import GeminiDDP, GeminiOptimizer
from colossal.optim import CPUAdam
from colossal.testkit import GPT, GPTConfig, lm_loss

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=512, block_size=64, n_embd=256, n_layer=int(sys.argv[2]), n_head=4))
states = 16 * sum(p.numel() for p in model.parameters())  # fp32 params + grads + Adam's two moments
before = status("VmRSS:")  # the user's model is built: what Gemini adds is measured from here
gem = GeminiDDP(model, chunk_size=1 << 18, placement="auto", device_memory_budget=12 << 20,
                host_memory_budget=20 << 20, disk_dir=sys.argv[1])
opt = GeminiOptimizer(CPUAdam(gem.parameters(), lr=1e-3, flatten=False), gem)
x, y = torch.randint(0, 512, (1, 8)), torch.randint(0, 512, (1, 8))
for _ in range(3):
    opt.zero_grad()
    opt.backward(lm_loss(gem(x), y))
    opt.step()
s = gem.stats_history[-1]
from colossal.gemini import host_memory
hwm = status("VmHWM:")
print(json.dumps(dict(bounded=host_memory._applied, states=states, growth=hwm - before, hwm=hwm,
                      rss=s.host_rss_bytes, rss_peak=s.host_rss_peak_bytes, host_peak=s.host_peak_bytes)))
"""


def _rss_run(directory, layers: int) -> dict:
    directory.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    cmd = [sys.executable, "-c", _RSS_RUN, str(directory), str(layers)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_real_peak_memory_does_not_grow_with_the_model(tmp_path):
    """#26 item 5: a 12 MiB device budget (host RAM on the CPU) + 20 MiB host budget, the rest on
    disk, at 62 and 123 MiB of model states. The process's peak RSS over the whole run (set-up,
    warm-up, steps) minus its RSS before Gemini is a constant that does not grow with the model:
    measured 99 and 85 MiB, against 199 and 337-370 MiB before the allocator was bounded ([Note: the
    allocator's peak]). The peak depends a little on how the I/O threads interleave (one CI run gave
    98 MiB at 123 MiB of states), so the bounds leave room: the growth may rise by at most half the
    added states, and at 123 MiB of states stays within the budgets + half the states + 32 MiB; the
    stats report the real figures next to the accounted ones."""
    small, big = _rss_run(tmp_path / "small", 5), _rss_run(tmp_path / "big", 10)
    for r in (small, big):
        assert r["bounded"] is (platform.libc_ver()[0] == "glibc"), r  # only glibc's threshold is set
        assert 0 < r["host_peak"] <= 20 << 20, r  # the account stays within the host budget
        assert 0 < r["rss"] <= r["rss_peak"], r
        assert 0.95 * r["hwm"] <= r["rss_peak"] <= r["hwm"], r  # the kernel's VmHWM at the last step
    allowed = (12 << 20) + (20 << 20) + big["states"] // 2 + (32 << 20)  # the issue's ~128 MiB of states
    assert big["growth"] <= allowed, f"peak RSS grew by {big['growth'] >> 20} MiB, allowed {allowed >> 20} MiB: {big}"
    added = big["states"] - small["states"]
    assert big["growth"] - small["growth"] <= added // 2, (small, big)


def test_the_users_allocator_setting_wins(monkeypatch):
    from colossal.gemini import host_memory

    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "33554432")  # glibc read it at start-up: left alone
    assert host_memory.bound_host_allocator() is False and host_memory.bound_host_allocator() is False
