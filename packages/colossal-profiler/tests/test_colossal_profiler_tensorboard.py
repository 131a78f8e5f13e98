"""TensorBoard output: scalars and text tables read back with tensorboard's EventAccumulator."""

import numpy as np
from profiler_helpers import scripted_step
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from colossal.profiler import crc32c


def test_crc32c_known_value():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_scalars_read_back(tmp_path):
    prof, *_ = scripted_step(out_dir=str(tmp_path), tokens_per_step=16)
    ea = EventAccumulator(str(tmp_path / "tensorboard" / "rank0"))
    ea.Reload()
    summary = prof.summaries[0]
    expected = {
        "profiler/step_time": summary["step_time"],
        "profiler/comm": summary["comm"],
        "profiler/overlap": summary["overlap"],
        "profiler/exposed_comm": summary["exposed_comm"],
        "profiler/idle": summary["idle"],
        "profiler/comm_bytes": summary["comm_bytes"],
        "profiler/tokens_per_s": summary["tokens_per_s"],
        "profiler/comm/all_reduce/busbw": 6000.0,
        "profiler/comm/reduce_scatter/time": 2.5,
    }
    for tag, value in expected.items():
        (event,) = ea.Scalars(tag)
        assert event.step == 0
        assert event.value == np.float32(value), tag  # simple_value is a float32
    assert "profiler/flops_per_s" not in ea.Tags()["scalars"]  # not counted, not written


def test_text_tables_read_back(tmp_path):
    prof, *_ = scripted_step(out_dir=str(tmp_path))
    ea = EventAccumulator(str(tmp_path / "tensorboard" / "rank0"))
    ea.Reload()
    (by_op,) = ea.Tensors("profiler/comm_by_op")
    assert tensor_util.make_ndarray(by_op.tensor_proto).item().decode() == prof.comm_table()
    (by_site,) = ea.Tensors("profiler/comm_by_site")
    assert tensor_util.make_ndarray(by_site.tensor_proto).item().decode() == prof.site_table()
