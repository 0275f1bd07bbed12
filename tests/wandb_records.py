"""Read a W&B offline run file (run-<id>.wandb) back, for the tests.

wandb 0.31 writes it from wandb-core (Go) and ships no Python reader: the file is a W&B header (":W&B",
magic 0xBEE1, version 0) followed by a LevelDB log (32 KiB blocks of records framed as crc32c(4), length(2),
type(1): 1 full, 2 first, 3 middle, 4 last), each record a wandb_internal_pb2.Record, the protobuf that
wandb ships in wandb/proto.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32 * 1024
HEADER = b":W&B"
FRAME = 7


def raw_records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    if data[:4] != HEADER:
        raise ValueError(f"{path}: not a W&B transaction log (starts with {data[:7]!r})")
    pos, pending = FRAME, b""  # the W&B header takes the first 7 bytes of the first block
    while pos + FRAME <= len(data):
        room = BLOCK - pos % BLOCK
        if room < FRAME:  # a block's tail too short for a frame is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + FRAME])
        if kind == 0 and length == 0:
            pos += room
            continue
        chunk = data[pos + FRAME : pos + FRAME + length]
        pos += FRAME + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def records(path: Path) -> Iterator[object]:
    from wandb.proto import wandb_internal_pb2

    for raw in raw_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        yield record


def history_rows(path: Path) -> list[dict[str, str]]:
    """Each history record as {key: value_json} (nested keys joined by '/'), wandb's own _step etc. left out."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def run_records(path: Path) -> list[object]:
    return [r.run for r in records(path) if r.WhichOneof("record_type") == "run"]
