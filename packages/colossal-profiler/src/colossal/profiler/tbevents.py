"""A minimal TensorBoard event-file writer: scalars and text, no TensorFlow or tensorboard needed.

[Note: why a hand-written writer]
The profiler depends on torch alone. ``torch.utils.tensorboard`` needs the ``tensorboard``
package, which brings protobuf, grpcio and more. An event file is simple: TFRecord framing
(length, masked CRC-32C of the length, payload, masked CRC-32C of the payload) around ``Event``
protocol buffers, of which we need five messages and a handful of fields, encoded below by hand.
TensorBoard reads the files as usual (the tests read them back with its ``EventAccumulator``).
"""

from __future__ import annotations

import functools
import os
import socket
import struct
import time

__all__ = ["EventWriter", "crc32c"]


def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``."""
    crc, table = 0xFFFFFFFF, _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1
    while True:
        bits, value = value & 0x7F, value >> 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _bytes(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def _event(step: int, summary: bytes = b"", file_version: str = "") -> bytes:
    msg = _field(1, 1, struct.pack("<d", time.time()))  # Event.wall_time (double)
    msg += _field(2, 0, _varint(step))  # Event.step
    if file_version:
        msg += _bytes(3, file_version.encode())  # Event.file_version
    if summary:
        msg += _bytes(5, summary)  # Event.summary
    return msg


@functools.lru_cache(maxsize=1024)
def _scalar_head(tag: str) -> bytes:
    # Summary.value (field 1) holding a Summary.Value: tag = 1, simple_value = 2 (fixed 4-byte float);
    # its length does not depend on the value, so everything before the float is cached per tag.
    tag_field = _bytes(1, tag.encode())
    return _field(1, 2, _varint(len(tag_field) + 5)) + tag_field + _varint(2 << 3 | 5)


def _scalar_value(tag: str, value: float) -> bytes:
    return _scalar_head(tag) + struct.pack("<f", value)


def _text_value(tag: str, text: str) -> bytes:
    plugin = _bytes(1, _bytes(1, b"text"))  # SummaryMetadata.plugin_data{plugin_name}
    tensor = _field(1, 0, _varint(7)) + _bytes(2, b"") + _bytes(8, text.encode())  # DT_STRING, shape [], string_val
    return _bytes(1, _bytes(1, tag.encode()) + _bytes(9, plugin) + _bytes(8, tensor))


class EventWriter:
    """Appends scalars and text to one ``events.out.tfevents.*`` file in ``logdir``."""

    def __init__(self, logdir: str) -> None:
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.colossal"
        self.path = os.path.join(logdir, name)
        """Path of the event file."""
        self._file = open(self.path, "ab")
        self._record(_event(0, file_version="brain.Event:2"))

    def _record(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._file.write(header + struct.pack("<I", _masked(crc32c(header))))
        self._file.write(data + struct.pack("<I", _masked(crc32c(data))))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Write ``values`` (tag -> number) at ``step``."""
        summary = b"".join(_scalar_value(tag, float(v)) for tag, v in values.items())
        self._record(_event(step, summary))

    def text(self, step: int, tag: str, text: str) -> None:
        """Write a markdown text (e.g. a table) at ``step``."""
        self._record(_event(step, _text_value(tag, text)))

    def flush(self) -> None:
        """Push buffered records to disk."""
        self._file.flush()

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()
