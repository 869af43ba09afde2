"""`PreparedObjects`: what one Accelerator prepared, in order; what its checkpoints cover."""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

_T = TypeVar("_T")


class PreparedObjects:
    """The models, optimizers, schedulers and data loaders an Accelerator prepared, in order.

    `save_state` writes them in this order and `load_state` restores them by position, so the
    lists only ever grow (by `prepare`) or are emptied together (by `free_memory`).
    """

    def __init__(self) -> None:
        self.models: list[nn.Module] = []
        self.optimizers: list[Any] = []  # AcceleratedOptimizers
        self.schedulers: list[Any] = []  # AcceleratedSchedulers
        self.dataloaders: list[Any] = []  # PositionedSources

    def holds(self, obj: Any) -> bool:
        """Whether `obj` is one of the prepared objects (by identity)."""
        return any(obj is p for pool in self._pools() for p in pool)

    @staticmethod
    def add(pool: list[Any], obj: _T) -> _T:
        """Appends `obj` to one of the lists above and returns it."""
        pool.append(obj)
        return obj

    def clear(self) -> None:
        """Forgets every prepared object."""
        for pool in self._pools():
            pool.clear()

    def _pools(self) -> tuple[list[Any], ...]:
        return self.models, self.optimizers, self.schedulers, self.dataloaders
