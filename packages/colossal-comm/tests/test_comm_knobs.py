"""colossal.comm.knobs: the one reading of a precision, a byte budget, a prefetch depth and an offload
fraction that every package uses."""

import pytest
import torch

from colossal.comm import as_bytes, as_count, as_dtype, as_fraction


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


def test_counts_and_fractions():
    assert as_count(0, "prefetch") == 0 and as_count(3, "prefetch") == 3
    assert as_fraction(1, "f") == 1.0 and isinstance(as_fraction(1, "f"), float) and as_fraction(0.25, "f") == 0.25
    for bad, error, message in [
        (True, TypeError, r"prefetch must be an int >= 0 \(0 turns it off, 1 is one ahead\), got bool True"),
        (2.0, TypeError, "prefetch must be an int >= 0, got float 2.0"),
        ("2", TypeError, "got str '2'"),
        (-1, ValueError, "prefetch must be an int >= 0, got -1"),
    ]:
        with pytest.raises(error, match=message):
            as_count(bad, "prefetch")
    for bad, error, message in [
        (False, TypeError, "offload_optim_frac must be a number in \\[0, 1\\], got bool False"),
        ("0.5", TypeError, "got str '0.5'"),
        (1.01, ValueError, r"offload_optim_frac must be in \[0, 1\], got 1.01"),
        (float("nan"), ValueError, "got nan"),
    ]:
        with pytest.raises(error, match=message):
            as_fraction(bad, "offload_optim_frac")
