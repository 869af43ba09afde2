"""The user's order, drawn as torch draws it, shared by every rank and replayed on resume.

A prepared map-style loader keeps the user's sampler, batch sampler and generator (Accelerate's
default `use_seedable_sampler=False`): one pass draws its order exactly as iterating the plain
DataLoader would, and from the same random numbers:

    iter(index sampler)            torch's _BaseDataLoaderIter.__init__ (a sampler may draw here)
    base seed                      one int64 from loader.generator, or the global torch RNG
    iter(index sampler) again      only with workers: _MultiProcessingDataLoaderIter._reset
    list(...)                      the sampler's lazy draws (RandomSampler seeds itself here)

With persistent workers torch draws the base seed on the first pass only, and so does this.
The index sampler is the loader's batch sampler, or its sampler for `batch_size=None`. The whole
epoch's order is read eagerly at pass start, so a global RNG stream after one prepared epoch is
where one plain epoch leaves it.

Several processes: rank 0 captures the state the order is drawn from (the global torch RNG, the
generators of the loader and its samplers, and `state_dict()` of a sampler that has one) and
broadcasts it once per pass; every rank draws from it, so all deal one order. Non-main ranks then
restore their own global RNG, so their streams are not disturbed, and keep the user's generators
in rank 0's post-draw state.

Resume: the capture is kept (`state_dict`), and a pass that continues an epoch (skip > 0) sets it
again, redraws the same order and base seed, and puts the live global RNG back. A sampler that
draws lazily from the global RNG while the epoch runs is replayed from its pass-start state: the
replay is exact as long as its draws happen when iteration starts, as RandomSampler's do.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from fittrain.common.checks import is_int
from fittrain.common.reprs import short_repr
from fittrain.data.seedable import seedable_samplers

#: What a capture holds besides the RNG states, saved in checkpoints (weights_only).
_FIELDS = ("epoch", "base_seed", "drew_base_seed")


def _generators_of(loader: DataLoader) -> list[torch.Generator]:
    """The torch generators the order may be drawn from, each once: the loader's and its samplers'."""
    holders = [loader, loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None)]
    found: list[torch.Generator] = []
    for holder in holders:
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and not any(generator is g for g in found):
            found.append(generator)
    return found


def _stateful_samplers(loader: DataLoader) -> dict[str, Any]:
    """The user's sampler and batch sampler, where they implement state_dict/load_state_dict."""
    parts = {"sampler": loader.sampler, "batch_sampler": loader.batch_sampler}
    return {name: part for name, part in parts.items()
            if callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))}


def draws_randomly(loader: DataLoader) -> bool:
    """False for a plain sequential order, whose ranks need not agree on any random state."""
    sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    if type(sampler) is BatchSampler:
        sampler = sampler.sampler
    return type(sampler) is not SequentialSampler


class EpochOrder:
    """Draws each pass's order from the user's sampler and generators, and replays it on resume.

    Args:
        loader: The user's DataLoader.
        share: Returns rank 0's object on every rank (a broadcast), or None when each rank draws
            from its own RNG (one process, or a sequential order).
        is_main: Whether this is rank 0, whose RNG the order is drawn from.
    """

    def __init__(self, loader: DataLoader, share: Callable[[Any], Any] | None, is_main: bool) -> None:
        self.index_sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
        self.loader_generator = loader.generator
        self.workers = loader.num_workers
        self.persistent = bool(loader.persistent_workers) and loader.num_workers > 0
        self.generators = _generators_of(loader)
        self.samplers = _stateful_samplers(loader)
        self.share, self.is_main = share, is_main
        self.captured: dict[str, Any] | None = None
        self._base_seed: int | None = None  # persistent workers: drawn on the first pass only
        self._seedable = seedable_samplers(loader)  # use_seedable_sampler: the order follows the epoch

    def draw(self, epoch: int, replay: bool) -> tuple[int, list[Any]]:
        """Returns the pass's base seed and its order (index batches, or keys for batch_size=None).

        `replay` continues epoch `epoch`: its captured state is set again when there is one, and
        every RNG and sampler is put back afterwards, as if nothing had been drawn.
        """
        for sampler in self._seedable:
            sampler.set_epoch(epoch)
        resuming = replay and self.captured is not None and self.captured["epoch"] == epoch
        state = self.captured if resuming else self._capture()
        if not resuming and self.share is not None:
            state = self.share(state)  # every rank draws from rank 0's state
        foreign = resuming or (self.share is not None and not self.is_main)
        live = self._capture() if resuming else {"rng": torch.get_rng_state()} if foreign else None
        if foreign:
            self._apply(state)
        if resuming:
            reuse = None if state["drew_base_seed"] else state["base_seed"]
        else:
            reuse = self._base_seed if self.persistent else None
        try:
            base_seed, order = self._draw_now(reuse)
        finally:
            if live is not None:
                self._apply(live)
        if self.persistent:
            self._base_seed = base_seed
        self.captured = dict(state, epoch=epoch, base_seed=base_seed, drew_base_seed=reuse is None)
        return base_seed, order

    def _draw_now(self, reuse: int | None) -> tuple[int, list[Any]]:
        """Consumes the RNGs as iterating the plain DataLoader does (see the module docstring)."""
        iterator = iter(self.index_sampler)
        base_seed = reuse
        if base_seed is None:
            base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.loader_generator).item())
            if self.workers > 0:
                iterator = iter(self.index_sampler)
        # Copies: read lazily, a batch sampler may refill one list for every batch; read eagerly, it must not.
        return base_seed, [list(item) if isinstance(item, list) else item for item in iterator]

    def _capture(self) -> dict[str, Any]:
        return {"rng": torch.get_rng_state(), "generators": [g.get_state() for g in self.generators],
                "samplers": {name: copy.deepcopy(part.state_dict()) for name, part in self.samplers.items()}}

    def _apply(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["rng"])
        self._set_parts(state)

    def _set_parts(self, state: dict[str, Any]) -> None:
        for generator, saved in zip(self.generators, state.get("generators", ())):
            generator.set_state(saved)
        for name, part in self.samplers.items() if "samplers" in state else ():
            part.load_state_dict(copy.deepcopy(state["samplers"][name]))

    def state_dict(self) -> dict[str, Any]:
        """The generators' and stateful samplers' states now, and under "pass" the last pass's
        capture (RNG and sampler states at its start, epoch, base seed), or None."""
        now = self._capture()
        return {"pass": self.captured, "generators": now["generators"], "samplers": now["samplers"]}

    def load_state_dict(self, state: Any) -> None:
        """Restores the generators and samplers, and the capture that a later pass with skip > 0
        in its epoch replays."""
        check_order_state(state, len(self.generators), sorted(self.samplers))
        self._set_parts(state)
        self.captured = state["pass"]
        if self.persistent and self.captured is not None:
            self._base_seed = self.captured["base_seed"]


def _is_rng_state(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.ndim == 1


def _parts_problem(state: dict[str, Any], generators: int, samplers: list[str]) -> str | None:
    found = state.get("generators")
    if not (isinstance(found, list) and len(found) == generators and all(_is_rng_state(g) for g in found)):
        return (f"it must hold {generators} generator state(s) (the loader's and samplers'). "
                f"Received: {len(found) if isinstance(found, list) else short_repr(found)}")
    names = state.get("samplers")
    if not (isinstance(names, dict) and sorted(names) == samplers):
        return (f"it must hold the states of samplers {samplers} (those with state_dict). "
                f"Received: {sorted(names) if isinstance(names, dict) else short_repr(names)}")
    return None


def _pass_problem(capture: Any, generators: int, samplers: list[str]) -> str | None:
    if not isinstance(capture, dict):
        return f"its 'pass' must be a dict or None. Received: {type(capture).__name__}"
    ints = [capture.get(k) for k in _FIELDS[:2]]
    if not all(is_int(v) for v in ints):
        return f"its pass {list(_FIELDS[:2])} must be ints. Received: {short_repr(ints)}"
    if not isinstance(capture.get("drew_base_seed"), bool) or not _is_rng_state(capture.get("rng")):
        return "its pass 'drew_base_seed' must be a bool and its 'rng' a torch RNG state (uint8 tensor)"
    return _parts_problem(capture, generators, samplers)


def check_order_state(state: Any, generators: int, samplers: list[str]) -> None:
    """Raises ValueError naming the field when `state` is not an `EpochOrder.state_dict()` this
    loader can restore.

    Args:
        state: A saved `EpochOrder.state_dict()`.
        generators: How many generators the live loader has.
        samplers: The names of its samplers that have their own state.
    """
    if not isinstance(state, dict):
        problem: str | None = f"it must be a dict. Received: {type(state).__name__}"
    else:
        problem = _parts_problem(state, generators, samplers)
        if problem is None and state.get("pass") is not None:
            problem = _pass_problem(state["pass"], generators, samplers)
    if problem:
        raise ValueError(f"The loader state's 'order' cannot be restored: {problem}. Build the DataLoader as "
                         "when it was saved (generator=, samplers).")
