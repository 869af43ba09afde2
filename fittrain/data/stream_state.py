"""What a stream can tell about itself: whether it shards itself by rank, and whether the state it
reports resumes it exactly.

A dataset that implements `state_dict()`/`load_state_dict()` (the protocol of torchdata's
`StatefulDataLoader` and of Hugging Face `datasets.IterableDataset`) is resumed from that state.
A state can be inexact: Hugging Face `datasets` does not save the contents of a shuffle buffer
(`IterableDataset.shuffle(buffer_size=...)`), and refills the buffer on load, so samples would be
lost or repeated. Such a stream is replayed instead: read again from the start of the pass, and
the consumed rounds passed over unbatched.
"""

from __future__ import annotations

from typing import Any

#: Set this attribute to True on a dataset whose `__iter__` already yields only this rank's share
#: (as `datasets.distributed.split_dataset_by_node` does), so that fittrain does not shard it again.
SHARDS_BY_RANK_ATTRIBUTE = "shards_by_rank"


def has_state(dataset: Any) -> bool:
    """Whether `dataset` implements the state_dict/load_state_dict protocol."""
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def _is_hugging_face(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("datasets.")


def _examples_iterables(node: Any, depth: int = 0) -> list[Any]:
    """The chain of a Hugging Face stream's examples iterables (shuffles, maps, interleaves, ...)."""
    if node is None or depth > 64:
        return []
    found = [node]
    for child in [getattr(node, "ex_iterable", None), *getattr(node, "ex_iterables", [])]:
        found += _examples_iterables(child, depth + 1)
    return found


def state_is_exact(dataset: Any) -> bool:
    """Whether loading the state `dataset` reports continues it with exactly the next sample.

    Hugging Face streams with a shuffle buffer are the known exception (the buffer is not saved).
    """
    if not _is_hugging_face(dataset):
        return True
    chain = _examples_iterables(getattr(dataset, "_ex_iterable", None))
    return not any(type(node).__name__ == "BufferShuffledExamplesIterable" for node in chain)


def shards_by_rank(dataset: Any) -> bool:
    """Whether `dataset` yields only this rank's share by itself (so fittrain must not shard it)."""
    if getattr(dataset, SHARDS_BY_RANK_ATTRIBUTE, False) is True:
        return True
    return _is_hugging_face(dataset) and getattr(dataset, "_distributed", None) is not None
