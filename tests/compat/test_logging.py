"""`fittrain.logging.get_logger`: Accelerate's multi-process logger, on one process.

The 2-process behaviour (main process only, every process, in rank order, before any
Accelerator) is tested on real gloo processes in tests/compat/test_local_sgd_ddp.py.
"""

from __future__ import annotations

import logging
import sys

import pytest

from fittrain.logging import get_logger


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> list[str]:
        return [record.getMessage() for record in self.records]


@pytest.fixture()
def records(request, monkeypatch):
    """A handler on a fresh logger named after the test; levels restored afterwards."""
    monkeypatch.delenv("ACCELERATE_LOG_LEVEL", raising=False)
    root_level = logging.getLogger().level
    name = f"fittrain_test.{request.node.name}"
    handler = _Records()
    logging.getLogger(name).addHandler(handler)
    handler.logger_name = name
    yield handler
    logging.getLogger(name).removeHandler(handler)
    logging.getLogger(name).setLevel(logging.NOTSET)
    logging.getLogger().setLevel(root_level)


def test_the_main_process_logs_with_its_rank(records) -> None:
    logger = get_logger(records.logger_name, log_level="INFO")
    logger.info("loss %.1f", 0.5)
    logger.debug("hidden")
    logger.info("everyone", main_process_only=False)
    logger.warning("in order", in_order=True)  # one process: once, no barrier needed
    assert records.messages == ["[RANK 0] loss 0.5", "[RANK 0] everyone", "[RANK 0] in order"]
    # The record points at this file's line, not at the adapter.
    assert {record.filename for record in records.records} == {"test_logging.py"}


def test_other_ranks_log_only_when_asked(records, monkeypatch) -> None:
    # Rank 1 of 2 as torchrun describes it; no process group is needed to know the rank.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    logger = get_logger(records.logger_name, log_level="INFO")
    logger.info("main only")
    logger.info("mine too", main_process_only=False)
    assert records.messages == ["[RANK 1] mine too"]


def test_the_level_comes_from_accelerate_log_level_unless_given(records, monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "debug")
    logger = get_logger(records.logger_name)
    assert logger.logger.level == logging.DEBUG and logging.getLogger().level == logging.DEBUG
    logger.debug("seen")
    assert records.messages == ["[RANK 0] seen"]
    assert get_logger(records.logger_name, log_level="ERROR").logger.level == logging.ERROR


def test_without_a_level_the_logger_keeps_its_own(records) -> None:
    logging.getLogger(records.logger_name).setLevel(logging.WARNING)
    assert get_logger(records.logger_name).logger.level == logging.WARNING


def test_a_bad_level_names_where_it_came_from(records, monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"get_logger\(log_level=...\).*Received: 'LOUD'"):
        get_logger(records.logger_name, log_level="LOUD")
    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "verbose")
    with pytest.raises(ValueError, match=r"environment variable ACCELERATE_LOG_LEVEL.*Received: 'verbose'"):
        get_logger(records.logger_name)
    with pytest.raises(TypeError, match=r"get_logger\(name=...\)"):
        get_logger(5)


def test_warning_once_drops_repeats(records) -> None:
    logger = get_logger(records.logger_name, log_level="INFO")
    for _ in range(3):
        logger.warning_once("deprecated")
    assert records.messages == ["[RANK 0] deprecated"]
    assert records.records[0].filename == "test_logging.py"


def test_the_module_does_not_shadow_the_standard_library() -> None:
    import fittrain.accelerator.accelerator  # noqa: F401 - fittrain's own `import logging` lines have run

    assert sys.modules["logging"] is logging and logging.__file__.endswith("logging/__init__.py")
    assert fittrain.logging.get_logger is get_logger and fittrain.logging is not logging
