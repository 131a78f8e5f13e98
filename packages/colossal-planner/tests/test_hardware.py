"""Hardware descriptions: presets, validation, this machine, and the calibration microbenchmark."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import pytest
import torch

from colossal.planner.calibrate import Coefficients, calibrate, load_coefficients, save_coefficients
from colossal.planner.hardware import HARDWARE_PRESETS, Hardware, hardware_preset, this_machine

H100 = HARDWARE_PRESETS["h100"]


def meminfo_total() -> int:
    for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def synthetic_coefficients(**changes) -> Coefficients:
    fields = dict(
        device_type="cpu",
        matmul_flops={"float32": 2e11, "bfloat16": 4e11, "float16": 3e9},
        elementwise_bandwidth=3e10,
        copy_bandwidth_h2d=1.8e10,
        copy_bandwidth_d2h=1.7e10,
        disk_read_bandwidth=1.4e9,
        disk_write_bandwidth=1.1e9,
        disk_read_method="O_DIRECT",
        collective={op: (1e-4, 1e-9) for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")},
        world_size=2,
        op_overhead_seconds=1e-6,
        machine={"node": "test", "cpu_count": 2},
        created="2026-01-01T00:00:00+00:00",
    )
    return Coefficients(**{**fields, **changes})


# --- presets ------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", sorted(HARDWARE_PRESETS))
def test_every_preset_is_valid_and_round_trips_through_json(key):
    hw = HARDWARE_PRESETS[key]
    assert hw.world_size == hw.devices_per_node * hw.nodes
    assert all(hw.flops(dtype) > 0 for dtype in ("fp32", "bf16", "fp16"))
    assert hw.pinnable_host_memory == hw.host_memory // 2
    back = Hardware.from_dict(json.loads(json.dumps(hw.to_dict())))
    assert back == hw and hash(back) == hash(hw)


def test_node_presets_have_eight_gpus_on_nvlink_and_datasheet_figures():
    for key in ("dgx-a100", "dgx-h100"):
        node = HARDWARE_PRESETS[key]
        assert node.devices_per_node == 8 and node.intra_node_bandwidth > node.inter_node_bandwidth
    assert HARDWARE_PRESETS["dgx-a100"].intra_node_bandwidth == pytest.approx(240e9)
    assert HARDWARE_PRESETS["rtx2060"].device_memory == 6 * 2**30
    assert HARDWARE_PRESETS["laptop-rtx2060"].host_memory == 16 * 2**30
    assert HARDWARE_PRESETS["h200"].device_memory == 141 * 10**9


def test_flops_accepts_torch_dtypes_and_names():
    assert H100.flops(torch.bfloat16) == H100.flops("bf16") == H100.flops("BFloat16") == 989e12
    assert H100.flops(torch.float32) == H100.flops("fp32") == 67e12
    with pytest.raises(ValueError, match="int8"):
        H100.flops("int8")


def test_preset_lookup_ignores_case_spaces_underscores_and_hyphens():
    assert hardware_preset("DGX H100") == HARDWARE_PRESETS["dgx-h100"]
    assert hardware_preset("a100_80GB") == hardware_preset("A100 80gb") == HARDWARE_PRESETS["a100-80gb"]
    assert hardware_preset("RTX-3090") == HARDWARE_PRESETS["rtx3090"]


def test_preset_overrides():
    hw = hardware_preset("h100", nodes=4, devices=8, host_memory="1TiB", pinned_host_memory=2**39)
    assert (hw.nodes, hw.devices_per_node, hw.world_size) == (4, 8, 32)
    assert (hw.host_memory, hw.pinnable_host_memory) == (2**40, 2**39)
    assert hw.flops("bf16") == H100.flops("bf16") and hw.device_memory == H100.device_memory


def test_unknown_preset_lists_the_names_and_suggests_one():
    with pytest.raises(ValueError, match="did you mean 'h100'") as info:
        hardware_preset("h10O")
    assert all(repr(key) in str(info.value) for key in HARDWARE_PRESETS)


def test_scaled_keeps_per_device_and_per_node_figures():
    cluster = HARDWARE_PRESETS["dgx-h100"].scaled(nodes=16)
    assert cluster.world_size == 128
    assert dataclasses.replace(cluster, nodes=1) == HARDWARE_PRESETS["dgx-h100"]
    assert H100.scaled(devices_per_node=4, name="4x H100").name == "4x H100"


# --- validation ---------------------------------------------------------------------------------
def test_zero_device_memory_names_the_field_and_value():
    with pytest.raises(ValueError, match=r"^Hardware\.device_memory must be > 0, got 0$"):
        H100.with_(device_memory=0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("host_memory", -1),
        ("memory_bandwidth", 0.0),
        ("intra_node_bandwidth", float("nan")),
        ("disk_read_bandwidth", -2e9),
        ("devices_per_node", 0),
        ("nodes", 0),
        ("link_latency", -1e-6),
    ],
)
def test_bad_figures_name_the_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"Hardware\.{field} must .*got {value}"):
        H100.with_(**{field: value})


def test_other_bad_descriptions_raise():
    with pytest.raises(ValueError, match="device_type must be one of .*'tpu'"):
        H100.with_(device_type="tpu")
    with pytest.raises(ValueError, match=r"missing \['float16'\]"):
        H100.with_(peak_flops={"fp32": 1e12, "bf16": 2e12})
    with pytest.raises(ValueError, match="pinned_host_memory must be <= host_memory"):
        H100.with_(pinned_host_memory=H100.host_memory + 1)
    with pytest.raises(TypeError, match="no field"):
        H100.with_(hbm=1)
    with pytest.raises(ValueError, match="unknown key"):
        Hardware.from_dict({**H100.to_dict(), "hbm": 1})
    assert H100.with_(disk_free=0, device_memory=80e9).device_memory == 80 * 10**9  # full disk; integral float


# --- this machine -------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="describes a CPU-only machine")
def test_this_machine_describes_this_cpu_box(tmp_path):
    hw = this_machine(tmp_path)
    assert (hw.device_type, hw.devices_per_node, hw.nodes) == ("cpu", 1, 1)
    assert hw.device_memory == hw.host_memory
    if pathlib.Path("/proc/meminfo").exists():
        assert hw.host_memory == meminfo_total()
    assert hw.disk_free > 0


# --- calibration --------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_calibrate_measures_saves_loads_and_applies(tmp_path):
    c = calibrate(device="cpu", disk_dir=tmp_path, world_size=2, seconds=3)
    figures = [
        *c.matmul_flops.values(),
        c.elementwise_bandwidth,
        c.copy_bandwidth_h2d,
        c.copy_bandwidth_d2h,
        c.disk_read_bandwidth,
        c.disk_write_bandwidth,
        c.op_overhead_seconds,
    ]
    assert all(math.isfinite(x) and x > 0 for x in figures), figures
    assert set(c.matmul_flops) == {"float32", "bfloat16", "float16"}
    assert (c.device_type, c.world_size) == ("cpu", 2)
    assert set(c.collective) == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    for alpha, beta in c.collective.values():
        assert 0 <= alpha < 1 and 0 < beta and math.isfinite(beta)
    assert list(tmp_path.iterdir()) == []  # the disk benchmark's file is gone

    path = save_coefficients(c, tmp_path / "cache" / "calibration.json")
    assert load_coefficients(path) == c

    hw = c.apply(this_machine(tmp_path))
    assert hw.peak_flops == c.matmul_flops and hw.memory_bandwidth == c.elementwise_bandwidth
    assert hw.host_link_bandwidth == min(c.copy_bandwidth_h2d, c.copy_bandwidth_d2h)
    assert (hw.disk_read_bandwidth, hw.disk_write_bandwidth) == (c.disk_read_bandwidth, c.disk_write_bandwidth)
    alpha, beta = c.collective["all_reduce"]
    assert (hw.link_latency, hw.intra_node_bandwidth) == (alpha, pytest.approx(1 / beta))  # bus factor 1 on 2 ranks
    assert this_machine(tmp_path, coefficients=c).peak_flops == c.matmul_flops


@pytest.mark.timeout(60)
def test_calibrate_without_collectives_keeps_the_hardware_links(tmp_path):
    c = calibrate(device="cpu", disk_dir=tmp_path, seconds=0.5, collectives=False)
    assert c.world_size == 1
    assert c.collective["all_reduce"] == (0.0, 1 / c.copy_bandwidth_h2d)
    base = this_machine(tmp_path)
    hw = c.apply(base)
    assert (hw.intra_node_bandwidth, hw.link_latency) == (base.intra_node_bandwidth, base.link_latency)


def test_bad_calibrate_arguments():
    with pytest.raises(ValueError, match="seconds must be a positive number, got 0"):
        calibrate(seconds=0)
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        calibrate(world_size=0)
    with pytest.raises(ValueError, match="disk_dir must be an existing directory"):
        calibrate(disk_dir="/nonexistent/colossal")


def test_coefficients_round_trip_and_validate():
    c = synthetic_coefficients()
    assert Coefficients.from_json(c.to_json()) == c and Coefficients.from_dict(c.to_dict()) == c
    assert c.bus_bandwidth("all_gather") == pytest.approx(0.5 / 1e-9)  # (n - 1) / n of the algorithm bandwidth
    with pytest.raises(ValueError, match=r"collective\['all_reduce'\] beta must be > 0, got 0"):
        synthetic_coefficients(collective={**c.collective, "all_reduce": (1e-4, 0.0)})
    with pytest.raises(ValueError, match="elementwise_bandwidth must be > 0, got -1"):
        synthetic_coefficients(elementwise_bandwidth=-1)
    with pytest.raises(ValueError, match="measured on 'cpu' cannot describe 'cuda'"):
        c.apply(H100)


def test_save_and_load_use_the_xdg_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    c = synthetic_coefficients()
    assert save_coefficients(c) == tmp_path / "colossal" / "planner-calibration.json"
    assert load_coefficients() == c


def test_loading_a_missing_file_says_to_calibrate(tmp_path):
    with pytest.raises(FileNotFoundError, match="colossalai plan --calibrate"):
        load_coefficients(tmp_path / "none.json")


@pytest.mark.parametrize("text", ["{not json", "[]", '{"device_type": "cpu"}'])
def test_loading_a_malformed_file_names_it(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="bad.json"):
        load_coefficients(path)
