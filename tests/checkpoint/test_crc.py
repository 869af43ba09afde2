"""CRC32 on several threads (`fittrain.checkpoint.crc`) gives exactly zlib's CRC32 of the whole.

The manifest lists zlib.crc32 of each file; a checksum joined from parts, or computed on a thread
beside a write, must be that same number, or every checkpoint would read as damaged (or, worse,
damage would pass). Each result is compared with zlib.crc32 of the same bytes in one piece.
"""

from __future__ import annotations

import mmap
import os
import pathlib
import random
import threading
import zlib

import pytest

from fittrain.checkpoint import crc


def test_combine_equals_the_crc_of_the_concatenation() -> None:
    rng = random.Random(0)
    lengths = [0, 1, 2, 3, 7, 8, 255, 4096, 65537, 1 << 20, (1 << 20) + 3]
    for first in lengths:
        for second in lengths:
            a, b = rng.randbytes(first), rng.randbytes(second)
            assert crc.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b), (first, second)


@pytest.mark.parametrize("size", [0, 1, 1000, 4096 * 3 + 5, 100_003, 300_007])
@pytest.mark.parametrize("cores", [1, 2, 3, 8])
def test_file_checksum_in_parts_equals_zlib(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                            size: int, cores: int) -> None:
    # Small thresholds, so that small files are read in as many parts as there are cores (up to 4),
    # each part mapped in several windows.
    monkeypatch.setattr(crc, "PARALLEL_MIN_BYTES", 1000)
    monkeypatch.setattr(crc, "_MAP_WINDOW", mmap.ALLOCATIONGRANULARITY)
    monkeypatch.setattr(crc, "_cores", lambda: cores)
    data = random.Random(size).randbytes(size)
    path = tmp_path / "file.bin"
    path.write_bytes(data)
    assert crc.file_checksum(path) == (size, zlib.crc32(data) if size else 0)
    assert crc.file_checksum(path, expected_size=size) == (size, zlib.crc32(data) if size else 0)


def test_a_large_file_uses_its_default_parts(tmp_path: pathlib.Path) -> None:
    data = random.Random(1).randbytes(2 * crc.PARALLEL_MIN_BYTES + 12345)
    path = tmp_path / "large.bin"
    path.write_bytes(data)
    assert crc.file_checksum(path) == (len(data), zlib.crc32(data))


def test_a_file_of_the_wrong_size_is_not_read(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "file.bin"
    path.write_bytes(b"x" * 100)
    monkeypatch.setattr(crc, "_crc32_range", lambda *args: pytest.fail("the file was read"))
    assert crc.file_checksum(path, expected_size=99) == (100, 0)


def test_a_file_that_shrinks_while_it_is_read_reports_the_size_read(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(crc, "PARALLEL_MIN_BYTES", 1000)
    monkeypatch.setattr(crc, "_cores", lambda: 1)
    path = tmp_path / "file.bin"
    path.write_bytes(b"y" * 10_000)
    read_range = crc._crc32_range

    def truncated_first(*args: object) -> tuple[int, int]:
        os.truncate(path, 6_000)  # another process cut the file after its size was taken
        return read_range(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(crc, "_crc32_range", truncated_first)
    assert crc.file_checksum(path, expected_size=10_000) == (6_000, 0)


@pytest.mark.parametrize("size", [10, crc.PARALLEL_MIN_BYTES + 1])
def test_crc32_beside_writes_everything_and_continues_the_running_crc(size: int) -> None:
    data = random.Random(size).randbytes(size)
    written: list[bytes] = []
    result = crc.crc32_beside(memoryview(data), zlib.crc32(b"head"), lambda view: written.append(bytes(view)))
    assert b"".join(written) == data
    assert result == zlib.crc32(b"head" + data)


def test_a_failed_write_raises_after_the_checksum_thread_ended() -> None:
    data = bytearray(crc.PARALLEL_MIN_BYTES)

    def full_disk(view: memoryview) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        crc.crc32_beside(memoryview(data), 0, full_disk)
    # The buffer may be reused at once: no checksum thread may still be reading it.
    assert not [t for t in threading.enumerate() if t.name == "fittrain-crc32"]


def test_the_fast_crc32_is_zlibs_crc32() -> None:
    """fittrain[fast]'s ISA-L CRC32 (installed with [dev]) writes and checks the very values zlib's does,
    so checkpoints read the same with it or without it."""
    import importlib.util

    expected = "isal" if importlib.util.find_spec("isal") else "zlib"
    assert crc.CRC32_IMPLEMENTATION == expected
    rng = random.Random(3)
    for size in (0, 1, 15, 4096, 1 << 20, (1 << 20) + 7):
        data = rng.randbytes(size)
        for start in (0, 1, 0xFFFFFFFF, 123456789):
            assert crc.crc32(data, start) == zlib.crc32(data, start), (size, start)
