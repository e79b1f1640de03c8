"""Which worker failure `meshlm train` reports: the launcher's reading of torchrun's error files."""

from __future__ import annotations

import json
import logging
import time

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from meshlm.app.launch import _first_failure


class _Err:
    def __init__(self, failures):
        self.failures = failures


def _error_file(root, rank, text):
    d = root / str(rank)
    d.mkdir(parents=True)
    f = d / "error.json"
    f.write_text(text)
    return f


def _record(message):
    return json.dumps({"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}})


def test_a_half_written_sibling_error_file_is_skipped_without_a_traceback(tmp_path, caplog):
    seen = _error_file(tmp_path, 1, _record("RuntimeError: Connection closed by peer"))
    _error_file(tmp_path, 0, "")  # rank 0 is still writing its own
    _error_file(tmp_path, 2, _record("ConfigError: offload.params=disk with the pipeline layout"))
    failure = ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=str(seen))
    with caplog.at_level(logging.DEBUG):
        rank, chosen = _first_failure(_Err({1: failure}))
    assert rank == 2 and "ConfigError" in json.dumps(chosen.message)
    # torch logs "Failed to parse reply file" with a traceback for a file it cannot parse;
    # meshlm train's stderr must not carry one for an error the user can fix
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
