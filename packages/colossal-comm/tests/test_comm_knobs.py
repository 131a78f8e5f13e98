"""colossal.comm.knobs: the one reading of a precision and of a byte budget that every package uses."""

import pytest
import torch

from colossal.comm import as_bytes, as_dtype


@pytest.mark.parametrize(
    "value, dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
        (torch.float16, torch.float16),
        ("fp16", torch.float16),
        ("half", torch.float16),
        (torch.float32, torch.float32),
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("no", torch.float32),
    ],
)
def test_every_precision_spelling(value, dtype):
    assert as_dtype(value) is dtype


@pytest.mark.parametrize(
    "value, error, message",
    [
        ("bf17", ValueError, "mixed_precision must be a torch dtype or one of"),
        (
            torch.int8,
            ValueError,
            "mixed_precision must be torch.float32, torch.float16 or torch.bfloat16, got torch.int8",
        ),
        (16, TypeError, "mixed_precision must be a torch.dtype or a string such as 'bf16', got int"),
    ],
)
def test_bad_precisions_name_the_knob_and_the_value(value, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(".", r"\.")):
        as_dtype(value)


@pytest.mark.parametrize(
    "value, nbytes",
    [
        (4096, 4096),
        ("4096", 4096),
        ("64MiB", 64 << 20),
        ("64 mib", 64 << 20),
        ("1.5GiB", 3 << 29),
        ("2KiB", 2048),
        ("512MB", 512 * 10**6),
        ("1e9", 10**9),
        ("1TB", 10**12),
        ("100B", 100),
        (4e9, 4 * 10**9),
    ],
)
def test_every_byte_spelling(value, nbytes):
    assert as_bytes(value, "device_memory_budget") == nbytes


@pytest.mark.parametrize(
    "value, error, message",
    [
        ("2XB", ValueError, "host_memory_budget must look like '64MiB'"),
        ("MiB", ValueError, "host_memory_budget must look like '64MiB'"),
        ("0", ValueError, "host_memory_budget must be a positive byte count, got '0'"),
        (0, ValueError, "host_memory_budget must be a positive byte count, got 0"),
        (-5, ValueError, "host_memory_budget must be a positive byte count, got -5"),
        ("1e999", ValueError, "host_memory_budget must be a finite byte count"),
        (True, TypeError, "host_memory_budget must be a byte count"),
        (2.5, TypeError, "host_memory_budget must be a byte count .* got float 2.5"),
    ],
)
def test_bad_byte_counts_name_the_knob_and_the_value(value, error, message):
    with pytest.raises(error, match=message):
        as_bytes(value, "host_memory_budget")
