"""The shard files' storage (`fittrain.checkpoint.dcp_io`): raw chunks read straight into their
targets, blocks cut out of chunks (resharding), and the chunk layouts metadata.json may describe.

Whole checkpoints are tested in test_sharded_checkpoint.py (one process) and
tests/checkpoint/test_sharded_fsdp.py (2 and 4); here DCP runs without a process group over
hand-made chunk layouts that one process cannot produce through FSDP2.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from fittrain.checkpoint import CheckpointError
from fittrain.checkpoint.dcp_io import (
    METADATA_NAME,
    RawReader,
    RawWriter,
    TensorsOnlyLoadPlanner,
    _span,
    metadata_from_json,
)


def _load(folder: pathlib.Path, targets: dict[str, torch.Tensor]) -> None:
    data = json.loads((folder / METADATA_NAME).read_text())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(targets, storage_reader=RawReader(folder, metadata_from_json(data)),
                 planner=TensorsOnlyLoadPlanner(), no_dist=True)


def _save(folder: pathlib.Path, tensors: dict[str, torch.Tensor], writer: FileSystemWriter) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=writer, no_dist=True)


def _chunked(folder: pathlib.Path, tensor: torch.Tensor, cuts: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """Writes `tensor` as the chunks (offsets, sizes) `cuts`, raw, as several ranks would have."""
    folder.mkdir()
    storage, offset = [], 0
    with open(folder / "__0_0.distcp", "wb") as f:
        for offsets, sizes in cuts:
            block = tensor[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].contiguous()
            data = block.numpy().tobytes()
            f.write(data)
            storage.append({"fqn": "w", "offset": list(offsets), "file": "__0_0.distcp", "start": offset,
                            "length": len(data)})
            offset += len(data)
    metadata = {"format": "fittrain-dcp-metadata", "version": "1", "items": "raw", "byteorder": sys.byteorder,
                "tensors": {"w": {"dtype": "float32", "size": list(tensor.shape),
                                  "chunks": [[list(o), list(s)] for o, s in cuts]}},
                "storage": storage}
    (folder / METADATA_NAME).write_text(json.dumps(metadata))


def test_raw_chunks_round_trip_for_every_dtype_and_shape(tmp_path) -> None:
    tensors = {"a": torch.randn(5, 3), "b": torch.arange(7, dtype=torch.int64), "c": torch.tensor(2.5),
               "d": torch.randn(4, 2).to(torch.bfloat16), "e": torch.tensor([True, False, True]),
               "f": torch.randn(6, 4).t(), "g": torch.empty(0, 3)}
    writer = RawWriter(tmp_path)
    _save(tmp_path, tensors, writer)
    assert list(writer.written) == ["__0_0.distcp"]
    size, _ = writer.written["__0_0.distcp"]
    assert size == os.path.getsize(tmp_path / "__0_0.distcp") == sum(t.numel() * t.element_size()
                                                                      for t in tensors.values())
    targets = {key: torch.full_like(t, 0).contiguous() for key, t in tensors.items()}
    _load(tmp_path, targets)
    for key, tensor in tensors.items():
        assert torch.equal(targets[key], tensor), key


def test_span_matches_the_elements_a_block_covers() -> None:
    """`_span` against brute force: the flat indices of each block of a 3x4x2 chunk."""
    sizes = (3, 4, 2)
    flat = torch.arange(24).reshape(sizes)
    for offsets in itertools.product(*(range(n) for n in sizes)):
        for lengths in itertools.product(*(range(1, n - o + 1) for n, o in zip(sizes, offsets))):
            block = flat[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))].reshape(-1)
            is_run = bool((block.diff() == 1).all())
            span = _span(sizes, offsets, lengths)
            assert (span is not None) == is_run, (offsets, lengths)
            if span is not None:
                assert span == (int(block[0]), block.numel())


def test_chunks_split_along_columns_load_into_a_whole_tensor(tmp_path) -> None:
    """Chunks cut along dimension 1 fill non-contiguous views of the target (through staging)."""
    tensor = torch.randn(4, 6)
    _chunked(tmp_path / "c", tensor, [((0, 0), (4, 3)), ((0, 3), (4, 3))])
    target = torch.zeros(4, 6)
    _load(tmp_path / "c", {"w": target})
    assert torch.equal(target, tensor)


class _Targets:
    """The two methods of a load planner that `RawReader` calls."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target, self.committed = target, []

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        view = self.target
        for dim, (offset, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(item)


def _read_block(folder: pathlib.Path, storage_offsets: tuple[int, int], lengths: tuple[int, int]) -> _Targets:
    """Reads one block of chunk "w" with `RawReader` alone, as DCP would for one read item."""
    reader = RawReader(folder, metadata_from_json(json.loads((folder / METADATA_NAME).read_text())))
    reader.set_up_storage_reader(reader.read_metadata(), is_coordinator=True)
    item = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("w", (0, 0)), dest_offsets=torch.Size((0, 0)),
                    storage_index=MetadataIndex("w", (0, 0)), storage_offsets=torch.Size(storage_offsets),
                    lengths=torch.Size(lengths))
    planner = _Targets(torch.zeros(lengths))
    reader.read_data(type("Plan", (), {"items": [item]})(), planner).wait()
    assert planner.committed == [item]
    return planner


@pytest.mark.parametrize("storage_offsets, lengths", [((1, 2), (2, 3)), ((2, 0), (2, 6)), ((0, 5), (1, 1))])
def test_a_block_cut_out_of_a_chunk_is_read_exactly(tmp_path, storage_offsets, lengths) -> None:
    """What a rank reads when the chunks it holds now cut across the saved ones (resharding)."""
    tensor = torch.randn(4, 6)
    _chunked(tmp_path / "c", tensor, [((0, 0), (4, 6))])
    target = _read_block(tmp_path / "c", storage_offsets, lengths).target
    rows, columns = (slice(o, o + n) for o, n in zip(storage_offsets, lengths))
    assert torch.equal(target, tensor[rows, columns])


def test_a_chunk_beyond_the_end_of_its_file_is_named(tmp_path) -> None:
    _chunked(tmp_path / "c", torch.randn(4, 6), [((0, 0), (4, 6))])
    with open(tmp_path / "c" / "__0_0.distcp", "r+b") as f:
        f.truncate(50)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp.* is damaged: it ends at byte 50"):
        _read_block(tmp_path / "c", (0, 0), (4, 6))


# Layouts of a 4x6 tensor as (offsets, sizes) chunks: ranks' grids that tile it, and damaged ones.
_TILINGS = {
    "rows": [((0, 0), (2, 6)), ((2, 0), (2, 6))],
    "a 2x2 grid": [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))],
    "rows, the second split in columns": [((0, 0), (2, 6)), ((2, 0), (2, 1)), ((2, 1), (2, 5))],
    "an empty chunk beside whole rows": [((0, 0), (4, 6)), ((4, 0), (0, 6))],
}
_NOT_TILINGS = {
    "a row missing": ([((0, 0), (3, 6))], "along dimension 0, indices 3 to 4 lie in no chunk"),
    "columns missing in one band": ([((0, 0), (2, 6)), ((2, 0), (2, 4))],
                                    "along dimension 1, indices 4 to 6 lie in no chunk"),
    "columns twice": ([((0, 0), (4, 4)), ((0, 2), (4, 4))], "along dimension 1, indices 2 to 4 lie in more than one"),
    "the same chunk twice": ([((0, 0), (4, 6)), ((0, 0), (4, 6))], r"the block at \[0, 0\] lies in more than one"),
    "only empty chunks": ([((0, 0), (0, 6))], "along dimension 0, indices 0 to 4 lie in no chunk"),
}


@pytest.mark.parametrize("layout", list(_TILINGS))
def test_chunks_that_tile_a_tensor_load_it_whole(tmp_path, layout) -> None:
    tensor = torch.randn(4, 6)
    _chunked(tmp_path / "c", tensor, _TILINGS[layout])
    target = torch.zeros(4, 6)
    _load(tmp_path / "c", {"w": target})
    assert torch.equal(target, tensor)


@pytest.mark.parametrize("layout", list(_NOT_TILINGS))
def test_chunks_that_do_not_tile_a_tensor_are_refused_when_parsed(tmp_path, layout) -> None:
    cuts, message = _NOT_TILINGS[layout]
    _chunked(tmp_path / "c", torch.randn(4, 6), cuts)
    data = json.loads((tmp_path / "c" / METADATA_NAME).read_text())
    with pytest.raises(ValueError, match=rf"the chunks of 'w' do not tile it: {message}"):
        metadata_from_json(data)


def test_scalars_and_empty_tensors_tile_with_their_one_chunk(tmp_path) -> None:
    tensors = {"step": torch.tensor(3.0), "empty": torch.empty(0, 5), "deep": torch.randn(*[1] * 40, 2)}
    _save(tmp_path, tensors, RawWriter(tmp_path))
    data = json.loads((tmp_path / METADATA_NAME).read_text())
    targets = {key: torch.zeros_like(t) for key, t in tensors.items()}
    _load(tmp_path, targets)
    assert all(torch.equal(targets[key], t) for key, t in tensors.items())
    data["tensors"]["step"]["chunks"] = []
    data["storage"] = [s for s in data["storage"] if s["fqn"] != "step"]
    with pytest.raises(ValueError, match=r"the chunks of 'step' do not tile it: the block at \[\] lies in no chunk"):
        metadata_from_json(data)


def test_chunks_that_share_bytes_are_refused(tmp_path) -> None:
    """Chunks read from the same bytes again and again could describe a tensor larger than every
    file together; `RawWriter` writes each chunk's bytes after the last."""
    _chunked(tmp_path / "c", torch.randn(4, 6), _TILINGS["rows"])
    data = json.loads((tmp_path / "c" / METADATA_NAME).read_text())
    data["storage"][1]["start"] = 8
    with pytest.raises(ValueError, match=r"the bytes of 'w' and 'w' overlap in '__0_0.distcp' \(at byte 8\)"):
        metadata_from_json(data)


def test_metadata_of_the_pre_release_format_is_refused_not_read(tmp_path) -> None:
    """fittrain 0.1.0 was never released: its shard files (a `torch.save` archive per chunk, and no
    "items" in metadata.json) are refused as damaged instead of read by a second reader."""
    _save(tmp_path, {"w": torch.randn(3, 5)}, RawWriter(tmp_path))
    data = json.loads((tmp_path / METADATA_NAME).read_text())
    del data["items"]
    with pytest.raises(ValueError, match=r'it has no "items" \(how its chunks are stored\)'):
        metadata_from_json(data)
    data["items"] = "torch.save"
    with pytest.raises(ValueError, match=r"its chunks are stored as 'torch.save', which fittrain does not know"):
        metadata_from_json(data)
