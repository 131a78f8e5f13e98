"""Corruption checks (checksums): moved to :mod:`colossal.comm.checkpoint.integrity` ([Note:
checksums] there); this module keeps the old import path working."""

from colossal.comm.checkpoint.integrity import (
    CHECKSUM_DIR,
    load_file_checked,
    verify_files,
    write_checksums,
    write_dcp_checksums,
)

__all__ = ["write_checksums", "write_dcp_checksums", "verify_files", "load_file_checked", "CHECKSUM_DIR"]
