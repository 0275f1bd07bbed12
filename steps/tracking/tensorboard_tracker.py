"""TensorBoard: one event file per iteration and source under <run>/tensorboard/, tensorboard's own Event protos in
TFRecord framing, written whole under a fixed name (so that a retried step replaces its file: no duplicate points).

The framing (tfrecord, with its CRC-32C) is written here rather than taken from a maintained writer, for a measured
reason: import time (bench/README.md, "The TensorBoard writer"). tensorboard 2.21.0 is already a dependency (its
protos, its reader in the tests, `tensorboard --logdir`), so its writers cost no new package, but each of them
imports tensorboard's TensorFlow stub: importing and writing one event file of 10 points in a fresh process took
205-281 ms with tensorboard's RecordWriter and 242-431 ms with torch.utils.tensorboard's SummaryWriter where torch
was already loaded (the score and update steps), and 315-354 ms with RecordWriter where it is not (the report step),
against 11-20 ms and 22-69 ms here (the protos alone; 5 runs each, 2 busy cores). tensorboardX 2.6.5 (an 87 KB
wheel, 652 KB installed, a new dependency) took 279-371 ms after torch and 1.4-2.1 s without. The writers also name
their files by time, host and pid and write them from a thread into a local directory: a retry would leave a second
file (duplicate points), and an S3 store would need a local copy uploaded after close. tests/test_tracking_contract.py
holds tfrecord to tensorboard's RecordWriter byte for byte.
"""

from __future__ import annotations

import struct
import time

from steps.run.keys import TENSORBOARD_PREFIX
from steps.store.object_store import Store
from steps.tracking.interface import Tracker, local_root, write_local_atomically

_CRC32C_TABLE: list[int] = []


def _crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), table-driven: event files are a few KB."""
    if not _CRC32C_TABLE:
        for n in range(256):
            for _ in range(8):
                n = (n >> 1) ^ 0x82F63B78 if n & 1 else n >> 1
            _CRC32C_TABLE.append(n)
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc32c(data: bytes) -> int:
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """One TFRecord: uint64 length, masked crc32c of the length, data, masked crc32c of the data (little
    endian). tensorboard's RecordWriter writes the same bytes (tests/test_tracking_contract.py) but importing it
    imports tensorboard's whole TensorFlow stub (the module docstring has the times)."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _masked_crc32c(length)) + data + struct.pack("<I", _masked_crc32c(data))


class TensorboardTracker(Tracker):
    """Event files under <run>/tensorboard/: `events.out.tfevents.<iteration>.<source>.moerl`, one per
    iteration and source, written whole (so a retry replaces it). Names sort by iteration, so TensorBoard's
    loader reads the steps in order."""

    name = "tensorboard"

    def __init__(self, run: Store):
        self.run = run

    @staticmethod
    def event_file_name(iteration: int, source: str) -> str:
        return f"events.out.tfevents.{iteration:010d}.{source}.moerl"

    @staticmethod
    def event_file_bytes(iteration: int, values: dict[str, float], wall_time: float | None = None) -> bytes:
        """A version event, then one Event with every point as a simple_value, in TFRecord framing."""
        from tensorboard.compat.proto import event_pb2, summary_pb2

        wall_time = time.time() if wall_time is None else wall_time
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=tag, simple_value=value) for tag, value in sorted(values.items())]
        )
        events = [
            event_pb2.Event(wall_time=wall_time, file_version="brain.Event:2"),
            event_pb2.Event(wall_time=wall_time, step=iteration, summary=summary),
        ]
        return b"".join(tfrecord(event.SerializeToString()) for event in events)

    def log_points(self, source: str, iteration: int, values: dict[str, float]) -> None:
        data = self.event_file_bytes(iteration, values)
        name = f"{TENSORBOARD_PREFIX}/{self.event_file_name(iteration, source)}"
        root = local_root(self.run)
        if root is not None:
            write_local_atomically(root / name, data)
        else:
            self.run.put_bytes(name, data)
