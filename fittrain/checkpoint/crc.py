"""CRC32 of checkpoint files on more than one core.

Every checkpoint byte is checksummed twice: when it is written and when it is read back. zlib's
CRC32 runs at about 2-3 GB/s on one core, as slow as the write or read itself. With the optional
`isal` package (`pip install fittrain[fast]`), `crc32` is ISA-L's instead: the same CRC-32, so the
same values in every manifest, at about 13 GB/s (measured on this project's CI machine). Either
releases the GIL, so both passes also hide part of it on another thread:

- `crc32_beside`: a large write's checksum runs on a thread while the same bytes are written.
- `file_checksum`: a large file is checksummed in parts on threads, and the parts' CRCs are
  joined with `crc32_combine` (zlib's own, which Python does not expose), so the result is the
  CRC32 of the whole file, as the manifest lists it. Each part is checksummed straight from the
  page cache through a memory map, a window at a time: reading it into a buffer first copied
  every byte once more, which cost as much as the checksum.
"""

from __future__ import annotations

import mmap
import os
import threading
import zlib
from collections.abc import Callable


def _fastest_crc32() -> tuple[Callable[..., int], str]:
    """ISA-L's CRC32 when `isal` is installed and agrees with zlib's, else zlib's; with its name."""
    try:
        from isal.isal_zlib import crc32 as isal_crc32  # optional: fittrain[fast]
    except ImportError:
        return zlib.crc32, "zlib"
    probe = bytes(range(256)) * 5
    if isal_crc32(probe) != zlib.crc32(probe) or isal_crc32(probe, 12345) != zlib.crc32(probe, 12345):
        return zlib.crc32, "zlib"  # a build that disagrees would call every checkpoint damaged
    return isal_crc32, "isal"


#: `crc32(data, value=0)`, zlib's signature and values; and which implementation it is.
crc32, CRC32_IMPLEMENTATION = _fastest_crc32()

# The CRC-32 polynomial (bit-reversed), as zlib uses it.
_POLY = 0xEDB88320
# What each part of `file_checksum` maps at a time: large enough for few system calls, small enough
# to stay out of sight in the process's memory (a whole file's map would count as resident, as much
# as the file, while it is checksummed: a rank verifying its shards would look as if it had loaded
# them twice). A multiple of every platform's mapping granularity.
_MAP_WINDOW = 16 * 1024 * 1024
#: Below this, a thread costs more than it saves.
PARALLEL_MIN_BYTES = 8 * 1024 * 1024
# At most this many parts per file; more cores than that rarely have the memory bandwidth to use.
_MAX_PARTS = 4


def _multiply(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial, both polynomials in zlib's bit-reversed form."""
    mask, product = 1 << 31, 0
    while True:
        if a & mask:
            product ^= b
            if a & (mask - 1) == 0:
                return product
        mask >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x_to_the_8n(n: int) -> int:
    """x^(8n) modulo the polynomial: the shift of a CRC past n zero bytes (square and multiply)."""
    result, square = 1 << 31, 1 << 30  # x^0 and x^1
    exponent = 8 * n
    while exponent:
        if exponent & 1:
            result = _multiply(square, result)
        exponent >>= 1
        square = _multiply(square, square)
    return result


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """Returns the CRC32 of A + B from crc32(A), crc32(B) and len(B), as zlib's crc32_combine.

    Args:
        crc1: zlib.crc32 of the first part.
        crc2: zlib.crc32 of the second part.
        length2: The second part's length in bytes.
    """
    return _multiply(_x_to_the_8n(length2), crc1) ^ crc2


def crc32_beside(view: memoryview, crc: int, write: Callable[[memoryview], None]) -> int:
    """Writes `view` with `write` while its CRC32 (continuing `crc`) is computed on a thread.

    The thread is always joined before this returns, also when `write` fails: the caller may free
    or reuse the buffer as soon as the call is over.

    Returns:
        zlib.crc32(view, crc).
    """
    if view.nbytes < PARALLEL_MIN_BYTES:
        write(view)
        return crc32(view, crc)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(crc32(view, crc)), name="fittrain-crc32")
    thread.start()
    try:
        write(view)
    finally:
        thread.join()
    return result[0]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        return os.cpu_count() or 1


def _crc32_range(path: str | os.PathLike[str], start: int, end: int) -> tuple[int, int]:
    """Size actually checksummed and CRC32 of the bytes [start, end) of a file, mapped a window at a
    time (`start` a multiple of `_MAP_WINDOW`, or 0)."""
    crc, position = 0, start
    with open(path, "rb", buffering=0) as f:
        while position < end:
            length = min(_MAP_WINDOW, end - position)
            try:
                window = mmap.mmap(f.fileno(), length, offset=position, access=mmap.ACCESS_READ)
            except (ValueError, OSError):  # the file shrank while it was checksummed: report its size
                return max(0, min(end, os.fstat(f.fileno()).st_size) - start), crc
            with window, memoryview(window) as view:
                crc = crc32(view, crc)
            position += length
    return position - start, crc


def file_checksum(path: str | os.PathLike[str], expected_size: int | None = None) -> tuple[int, int]:
    """Returns the size and CRC32 of a file, a large one read and checksummed in parts on threads.

    When `expected_size` is given and differs from the file's size, the size is returned with a
    CRC32 of 0 without reading the file: the file is damaged either way. A file that shrinks
    while it is read gets the size read, so it fails the manifest's size check.
    """
    size = os.stat(path).st_size
    if size == 0 or (expected_size is not None and size != expected_size):
        return size, 0
    parts = max(1, min(_MAX_PARTS, _cores(), size // PARALLEL_MIN_BYTES))
    # Part boundaries on window boundaries, where a map may start.
    bounds = sorted({(size * i // parts) // _MAP_WINDOW * _MAP_WINDOW for i in range(parts)} | {size})
    parts = len(bounds) - 1
    results: list[tuple[int, int]] = [(0, 0)] * parts
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = _crc32_range(path, bounds[i], bounds[i + 1])
        except BaseException as err:  # re-raised below, in the calling thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,), name="fittrain-crc32") for i in range(1, parts)]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    read, crc = 0, 0
    for (count, part_crc), start, end in zip(results, bounds, bounds[1:]):
        read += count
        if count != end - start:  # shrank meanwhile: damaged, whatever its checksum
            return read, 0
        crc = crc32_combine(crc, part_crc, count)
    return read, crc
