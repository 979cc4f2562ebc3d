"""The failure record: what a failing worker writes is what the launcher reads back."""

import json

from nccl_ddp.job.failure_record import ERROR_FILE_VAR, FailureRecord, record_failure


def test_record_round_trips_and_the_first_failure_wins(tmp_path):
    path = str(tmp_path / "error.json")
    try:
        try:
            raise ConnectionError("peer rank 3 closed the connection")
        except ConnectionError as cause:
            raise RuntimeError("all_reduce failed") from cause
    except RuntimeError as e:
        record_failure(e, {ERROR_FILE_VAR: path, "RANK": "1"})
    record_failure(ValueError("later"), {ERROR_FILE_VAR: path, "RANK": "1"})
    rec = FailureRecord.read(path)
    assert rec is not None
    assert (rec.type, rec.message, rec.rank, rec.blames) == ("RuntimeError", "all_reduce failed", 1, 3)
    assert rec.time is not None and rec.pid is not None


def test_a_malformed_record_reads_as_unknowns(tmp_path):
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"type": None, "message": 7, "rank": "0", "blames": True, "time": "x"}))
    assert FailureRecord.read(str(path)) == FailureRecord("error", "7")
    path.write_text("[1, 2]")
    assert FailureRecord.read(str(path)) is None
    assert FailureRecord.read(str(tmp_path / "absent.json")) is None
