"""What reaches stderr and train.log: mingpt's INFO
lines, other libraries' warnings, not their INFO."""

from __future__ import annotations

import logging
import logging.handlers

import pytest

from mingpt.config import Config
from mingpt.distributed import SAME_ON_EVERY_RANK, setup_logging
from mingpt.run import run
from mingpt.rundir import Claim, hold_log_lines
from mingpt.storage import StorageError


@pytest.fixture
def root_logger():
    """setup_logging replaces the root logger's handlers and level: put them back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def test_third_party_info_stays_out_of_stderr_and_train_log(tmp_path, capsys, root_logger):
    setup_logging(rank=0)
    buffer = hold_log_lines(0)  # as mingpt.run does: lines before the run is accepted are kept
    logging.getLogger("botocore.credentials").info("Found credentials in environment variables.")
    logging.getLogger("mingpt.run").info("run directory here")
    claim = Claim(str(tmp_path), str(tmp_path / "snapshot.pt"), [], buffer)
    claim.accept({})
    logging.getLogger("botocore.credentials").info("Found credentials again")
    logging.getLogger("s3fs").warning("a third-party warning")
    logging.getLogger("mingpt.trainer").info("a line of ours")
    logging.getLogger("__main__").info("a line of python -m mingpt.generate")
    claim.release()
    err = capsys.readouterr().err
    log_file = (tmp_path / "train.log").read_text(encoding="utf-8")
    for shown in (err, log_file):
        assert "Found credentials" not in shown
        for line in (
            "run directory here",
            "WARNING a third-party warning",
            "a line of ours",
            "a line of python -m mingpt.generate",
        ):
            assert line in shown, shown


def test_a_run_refused_before_it_claims_its_directory_keeps_no_log_buffer(
    tmp_path, root_logger, monkeypatch
):
    """Lines held for train.log (hold_log_lines) are let go when start-up refuses the run before
    it owns its directory: a caller in the same process keeps no buffer on the root logger."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("a file where a directory should be\n")
    config = Config()
    config.trainer_config.device = "cpu"
    with pytest.raises(StorageError):
        run(config, str(tmp_path / "afile" / "run"), {}, [])
    assert not [h for h in root_logger.handlers if isinstance(h, logging.handlers.MemoryHandler)]


def test_other_ranks_log_their_own_warnings_not_those_every_rank_logs_alike(capsys, root_logger):
    setup_logging(rank=1)
    log = logging.getLogger("mingpt.trainer")
    log.warning("rank 1 cannot write here")
    log.warning("the same on every rank", extra=SAME_ON_EVERY_RANK)
    log.info("an info line")
    assert capsys.readouterr().err.endswith(" WARNING rank 1 cannot write here\n")
