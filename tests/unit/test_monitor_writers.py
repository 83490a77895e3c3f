"""The monitor's file formats: CRC-32C, TFRecord framing, Event protobufs, the CSV and TensorBoard writers."""
import csv
import io
import math
import os
import random
import struct

import pytest

from zeroengine.monitor import CsvMonitor, MonitorMaster, StepRecord, TensorBoardMonitor, read_event_file, read_scalars
from zeroengine.monitor.crc32c import crc32c, masked_crc32c
from zeroengine.monitor.event_proto import FILE_VERSION, Event, decode_event, encode_event
from zeroengine.monitor.tfrecord import RecordCorruptError, encode_record, read_records


# -- CRC-32C ------------------------------------------------------------------
@pytest.mark.parametrize("data,expected", [
    (b"123456789", 0xE3069283),       # the standard check value of CRC-32C
    (b"", 0x00000000),
    (bytes(32), 0x8A9136AA),          # RFC 3720 (iSCSI) B.4 test vectors
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
])
def test_crc32c_known_vectors(data, expected):
    assert crc32c(data) == expected


def test_crc32c_continues_over_chunks():
    data = random.Random(0).randbytes(1000)
    assert crc32c(data[400:], crc32c(data[:400])) == crc32c(data)


def test_masked_crc_is_the_tfrecord_rotation_plus_constant():
    crc = 0xE3069283
    rotated = ((crc >> 15) | (crc << 17)) & 0xFFFFFFFF
    assert masked_crc32c(b"123456789") == (rotated + 0xA282EAD8) & 0xFFFFFFFF


def test_masked_crc_matches_tensorboards_own_if_installed():
    stub = pytest.importorskip("tensorboard.compat.tensorflow_stub.pywrap_tensorflow")
    rng = random.Random(1)
    for n in (0, 1, 7, 8, 100, 1000):
        data = rng.randbytes(n)
        assert masked_crc32c(data) == stub.masked_crc32c(data)


# -- TFRecord framing -----------------------------------------------------------
def test_records_round_trip_and_layout():
    payloads = [b"", b"a", bytes(range(256)) * 3]
    blob = b"".join(encode_record(p) for p in payloads)
    assert list(read_records(io.BytesIO(blob))) == payloads
    first = encode_record(b"a")
    assert len(first) == 8 + 4 + 1 + 4 and struct.unpack("<Q", first[:8])[0] == 1


@pytest.mark.parametrize("where", [0, 9, 12, 13])  # length, length crc, payload, payload crc
def test_a_flipped_byte_is_detected(where):
    blob = bytearray(encode_record(b"x"))
    blob[where] ^= 0x01
    with pytest.raises(RecordCorruptError):
        list(read_records(io.BytesIO(bytes(blob))))


def test_a_truncated_record_is_detected():
    blob = encode_record(b"hello") + encode_record(b"world")
    with pytest.raises(RecordCorruptError):
        list(read_records(io.BytesIO(blob[:-3])))


# -- Event protobuf -------------------------------------------------------------
def test_event_round_trip():
    event = Event(wall_time=1234.5, step=7, scalars={"train/loss": 2.5, "memory/params": 1024.0, "é": -1.0})
    back = decode_event(encode_event(event))
    assert back == event
    assert decode_event(encode_event(Event(wall_time=1.0, step=-3))).step == -3  # int64 two's complement
    version = decode_event(encode_event(Event(wall_time=2.0, file_version=FILE_VERSION)))
    assert version.file_version == FILE_VERSION and not version.scalars


def test_event_bytes_are_the_protobuf_wire_format():
    # Hand-assembled: wall_time (field 1, fixed64), step (field 2, varint 300 = ac 02),
    # summary (field 5) > value (field 1) > tag (field 1) "a", simple_value (field 2, fixed32) 1.0.
    value = b"\x0a\x01a" + b"\x15" + struct.pack("<f", 1.0)
    expected = b"\x09" + struct.pack("<d", 0.5) + b"\x10\xac\x02" + b"\x2a" + bytes([len(value) + 2]) + b"\x0a" + \
        bytes([len(value)]) + value
    assert encode_event(Event(wall_time=0.5, step=300, scalars={"a": 1.0})) == expected


def test_decoder_skips_unknown_fields():
    data = encode_event(Event(wall_time=1.0, step=2, scalars={"x": 3.0}))
    # field 4 (fixed64, TF's log_message slot uses other numbers), field 9 varint, field 10 bytes
    data += b"\x21" + struct.pack("<d", 9.0) + b"\x48\x05" + b"\x52\x03abc"
    assert decode_event(data) == Event(wall_time=1.0, step=2, scalars={"x": 3.0})


# -- writers --------------------------------------------------------------------
def _records(n=3):
    return [StepRecord(step=i + 1, samples=8 * (i + 1), wall_time=1000.0 + i,
                       metrics={"train/loss": 4.0 / (i + 1), "train/lr": 1e-3 * (i + 1), "memory/params": 4096 * i})
            for i in range(n)]


def test_tensorboard_writer_reads_back(tmp_path):
    monitor = TensorBoardMonitor(str(tmp_path))
    assert "tfevents" in os.path.basename(monitor.path)
    records = _records()
    for r in records:
        monitor.write(r)
        # flushed at each write: readable while the writer is still open
        assert read_event_file(monitor.path)[-1].step == r.step
    monitor.close()
    monitor.close()  # idempotent
    events = read_event_file(monitor.path)
    assert events[0].file_version == FILE_VERSION and len(events) == 1 + len(records)
    scalars = read_scalars(monitor.path)
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]
    for tag in ("train/loss", "train/lr", "memory/params"):
        expected = [struct.unpack("<f", struct.pack("<f", r.metrics[tag]))[0] for r in records]  # float32
        assert [v for _, v in scalars[tag]] == expected


def test_tensorboard_event_accumulator_parses_our_file(tmp_path):
    ea_module = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    monitor = TensorBoardMonitor(str(tmp_path))
    for r in _records(4):
        monitor.write(r)
    monitor.close()
    acc = ea_module.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/loss", "train/lr", "memory/params"}
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([4.0, 2.0, 4 / 3, 1.0], rel=1e-6)
    assert loss[2].wall_time == 1002.0


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_csv_writer_rows_columns_and_exact_values(tmp_path):
    monitor = CsvMonitor(str(tmp_path))
    records = _records()
    records[2].metrics.pop("train/lr")  # a metric missing from one step leaves its cell empty
    for r in records:
        monitor.write(r)
    rows = _read_csv(monitor.path)  # flushed before close
    monitor.close()
    assert rows[0] == ["step", "samples", "wall_time", "train/loss", "train/lr", "memory/params"]
    assert [int(r[0]) for r in rows[1:]] == [1, 2, 3] and [int(r[1]) for r in rows[1:]] == [8, 16, 24]
    assert [float(r[3]) for r in rows[1:]] == [4.0, 2.0, 4.0 / 3]  # repr: read back exactly
    assert rows[1][4] == repr(1e-3) and rows[3][4] == ""
    assert rows[2][5] == "4096"  # integers stay integers


def test_csv_appends_to_the_same_columns_and_moves_other_files_aside(tmp_path):
    first = CsvMonitor(str(tmp_path))
    first.write(_records(1)[0])
    first.close()
    resumed = CsvMonitor(str(tmp_path))
    resumed.write(_records(2)[1])
    resumed.close()
    rows = _read_csv(resumed.path)
    assert [r[0] for r in rows] == ["step", "1", "2"]

    other = CsvMonitor(str(tmp_path))
    other.write(StepRecord(step=1, samples=4, wall_time=5.0, metrics={"train/loss": 1.0}))
    other.close()
    assert _read_csv(other.path) == [["step", "samples", "wall_time", "train/loss"], ["1", "4", "5.000", "1.0"]]
    aside = [name for name in os.listdir(tmp_path) if name.endswith(".old")]
    assert len(aside) == 1 and [r[0] for r in _read_csv(tmp_path / aside[0])] == ["step", "1", "2"]


class _Broken(CsvMonitor):
    def write(self, record):
        raise OSError("No space left on device")


def test_master_drops_a_failing_writer_and_keeps_the_others(tmp_path, caplog):
    good, bad = CsvMonitor(str(tmp_path / "good")), _Broken(str(tmp_path / "bad"))
    master = MonitorMaster([bad, good])
    for r in _records(2):
        master.write(r)
    assert master.monitors == [good]
    assert "No space left on device" in caplog.text
    assert len(_read_csv(good.path)) == 3
    master.close()
    master.close()
    assert good._file is None


def test_nan_and_inf_survive_both_writers(tmp_path):
    record = StepRecord(step=1, samples=1, wall_time=1.0, metrics={"train/loss": math.nan, "train/grad_norm": math.inf})
    c, t = CsvMonitor(str(tmp_path)), TensorBoardMonitor(str(tmp_path))
    for m in (c, t):
        m.write(record)
        m.close()
    row = _read_csv(c.path)[1]
    assert math.isnan(float(row[3])) and float(row[4]) == math.inf
    scalars = read_scalars(t.path)
    assert math.isnan(scalars["train/loss"][0][1]) and scalars["train/grad_norm"][0][1] == math.inf


def test_two_writers_into_one_job_directory_keep_each_others_records(tmp_path):
    # a second initialize() into the same job in the same second: the event file names were equal (the
    # second truncated the first), and the first CSV writer overwrote the second's rows from its position
    first_tb, second_tb = TensorBoardMonitor(str(tmp_path)), TensorBoardMonitor(str(tmp_path))
    assert first_tb.path != second_tb.path
    first_csv, second_csv = CsvMonitor(str(tmp_path)), CsvMonitor(str(tmp_path))
    records = _records(4)
    for writer_tb, writer_csv, r in zip((first_tb, second_tb) * 2, (first_csv, second_csv) * 2, records):
        writer_tb.write(r)
        writer_csv.write(r)
    for m in (first_tb, second_tb, first_csv, second_csv):
        m.close()
    assert [s for s, _ in read_scalars(first_tb.path)["train/loss"]] == [1, 3]
    assert [s for s, _ in read_scalars(second_tb.path)["train/loss"]] == [2, 4]
    with open(first_csv.path, newline="") as f:
        rows = list(csv.reader(f))
    assert [row[0] for row in rows[1:]] == ["1", "2", "3", "4"] and rows.count(rows[0]) == 1
