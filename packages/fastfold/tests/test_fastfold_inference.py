"""The inference API and CLI (time and peak memory per rank), weights given on the command line,
and the training step with activation checkpointing: DAP=2 takes the same step as DAP=1."""

import json

import numpy as np
import pytest
import torch
from fastfold_testutils import rand, rand_mask, randomize_, tiny_evo

from colossal.comm.testing import run_distributed
from fastfold import Dap, EvoformerStack
from fastfold.inference import TrunkSpec, _load, main, run_evoformer
from fastfold.training import train_step
from fastfold.weights import alphafold_params, openfold_state_dict


def test_run_evoformer_reports_and_matches_forward():
    model = randomize_(EvoformerStack(tiny_evo()).double()).eval()
    m, z, mask = rand(3, 6, 12), rand(6, 6, 8), rand_mask(3, 6)
    (m_out, z_out, s_out), seconds, peak, act = run_evoformer(model, m, z, mask, chunk_size=2, inplace=True)
    with torch.no_grad():
        ref = model(m, z, mask)
    for a, b in zip((m_out, z_out, s_out), ref):
        torch.testing.assert_close(a, b)
    assert seconds > 0 and peak > 0 and 0 <= act <= peak


def test_cli_dap2_chunked_json(capsys):
    main(
        ["--n-seq", "3", "--n-res", "7", "--c-m", "16", "--c-z", "8", "--blocks", "1", "--dap-size", "2"]
        + ["--chunk-size", "3", "--inplace", "--json"]
    )
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["spec"]["dap_size"] == 2 and [r["rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["seconds"] > 0 and r["peak_rss_bytes"] > 0 for r in report["ranks"])


@pytest.mark.parametrize("fmt", ["npz", "pt"])
def test_cli_weights_file(tmp_path, fmt):
    spec = TrunkSpec(n_seq=2, n_res=4, c_m=16, c_z=8, blocks=1)
    ref, _ = _load(spec, torch.device("cpu"))
    randomize_(ref)
    path = tmp_path / f"w.{fmt}"
    if fmt == "npz":
        np.savez(path, **alphafold_params(ref))
    else:
        torch.save(openfold_state_dict(ref, "evoformer."), path)
    loaded, _ = _load(
        TrunkSpec(n_seq=2, n_res=4, c_m=16, c_z=8, blocks=1, weights=str(path), seed=1), torch.device("cpu")
    )
    for a, b in zip(ref.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)


def test_spec_errors():
    with pytest.raises(ValueError, match="dap_size 8 is larger than the number of residues 4"):
        TrunkSpec(n_res=4, dap_size=8)
    with pytest.raises(ValueError, match="dtype must be one of"):
        TrunkSpec(dtype="float8")
    with pytest.raises(ValueError, match="n_seq must be positive"):
        TrunkSpec(n_seq=0)


def _loss(m, z, s):
    return (m * rand(*m.shape, seed=11)).sum() + (z * rand(*z.shape, seed=12)).sum() + s.pow(2).sum()


def rank_train_step():
    cfg = tiny_evo(msa_dropout=0.0, pair_dropout=0.0)
    inputs = {"m": rand(3, 7, 12), "z": rand(7, 7, 8), "msa_mask": rand_mask(3, 7), "pair_mask": rand_mask(7, 7)}
    results = []
    for dap in (None, Dap()):
        model = randomize_(EvoformerStack(cfg).double())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = train_step(model, inputs, opt, _loss, dap=dap, checkpoint=True)
        results.append((loss, [p.detach().clone() for p in model.parameters()]))
    (loss_1, params_1), (loss_2, params_2) = results
    assert abs(loss_1 - loss_2) <= 1e-9 * abs(loss_1)
    for a, b in zip(params_1, params_2):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    return True


def test_train_step_dap2_equals_dap1():
    assert run_distributed(rank_train_step, 2, timeout=180) == [True, True]
