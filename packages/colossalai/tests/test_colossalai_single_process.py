"""Every plugin works in a plain single process, without ``launch()`` (a world of one is made for
it; ZeRO, FSDP and hybrid used to raise), ``Booster.clip_grad_norm`` returns the total norm before
clipping for every plugin (ZeRO and Gemini used to return None), and the profiler takes the boosted
optimizer. Reference: ``torch.nn.utils.clip_grad_norm_`` on the plain model, fp32, 1e-5 relative.

Each case runs in a fresh interpreter: the process group it creates must not leak into other tests.
"""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import copy, json, sys
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    import colossalai.booster as B
    from colossalai import Booster
    from colossalai.models import build_gpt
    from colossal.profiler import Profiler

    name = sys.argv[1]
    assert not dist.is_initialized()
    kwargs = {"GeminiPlugin": {"device_memory_budget": 1 << 26}, "HybridParallelPlugin": {"tp_size": 1}}
    torch.manual_seed(0)
    model = build_gpt("tiny", seed=0, block_size=16)
    ref = copy.deepcopy(model)
    x = torch.randint(0, 64, (2, 16))
    y = torch.randint(0, 64, (2, 16))
    loss_of = lambda m: F.cross_entropy(m(x).flatten(0, 1).float(), y.flatten())
    loss_of(ref).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1).item()
    booster = Booster(plugin=getattr(B, name)(**kwargs.get(name, {})))
    m, o, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with Profiler(m, o, discover=False, memory=False) as prof:
        booster.backward(loss_of(m), o)
        norm = booster.clip_grad_norm(o, 0.1)
        o.step()
        o.zero_grad()
        prof.step()
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    print(json.dumps({"norm": float(norm), "want": want, "world": dist.get_world_size() if dist.is_initialized() else 1,
                      "phases": sorted(prof.summaries[0]["phases"])}))
    """
)

PLUGINS = ["TorchDDPPlugin", "TorchFSDPPlugin", "ZeroPlugin", "GeminiPlugin", "HybridParallelPlugin"]


@pytest.mark.parametrize("plugin", PLUGINS)
def test_plugin_runs_in_a_plain_process_and_clip_returns_the_norm(plugin):
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, plugin], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["world"] == 1
    assert got["norm"] == pytest.approx(got["want"], rel=1e-5)
    assert "optimizer" in got["phases"]  # the profiler timed the boosted optimizer's step
