"""Capture and restore every RNG a training step may draw from: Python, NumPy, torch, CUDA.

States are kept as tensors and plain numbers, so a checkpoint stores them in a file that
`torch.load(weights_only=True)` reads without unpickling arbitrary objects.

A checkpoint holds one state per process. A resume on more processes gives each process the
saving run did not have states derived from process 0's and its rank (`derive_rank_state`).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Callable

import numpy as np
import torch

from fittrain.common.checks import is_int
from fittrain.common.reprs import short_repr


def capture_rng_state() -> dict[str, Any]:
    """Returns this process's RNG states as tensors and numbers."""
    version, words, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python_version": version,
        "python_state": torch.tensor(words, dtype=torch.int64),
        "python_gauss": gauss,
        "numpy_kind": np_kind,
        "numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _python_state(state: dict[str, Any]) -> tuple[Any, ...]:
    return state["python_version"], tuple(state["python_state"].tolist()), state["python_gauss"]


def _numpy_state(state: dict[str, Any]) -> tuple[Any, ...]:
    return (state["numpy_kind"], state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"],
            state["numpy_has_gauss"], state["numpy_gauss"])


_FIELDS: tuple[tuple[str, Callable[[Any], bool]], ...] = tuple({
    "python_version": is_int,
    "python_state": lambda v: isinstance(v, torch.Tensor) and v.dtype == torch.int64 and v.dim() == 1,
    "python_gauss": lambda v: v is None or isinstance(v, float),
    "numpy_kind": lambda v: isinstance(v, str),
    "numpy_keys": lambda v: (isinstance(v, torch.Tensor) and v.dtype == torch.int64 and v.shape == (624,)
                             and bool(((v >= 0) & (v < 2**32)).all())),
    "numpy_pos": lambda v: is_int(v) and 0 <= v <= 624,  # NumPy's set_state does not check the position
    "numpy_has_gauss": lambda v: v in (0, 1) and is_int(v),
    "numpy_gauss": lambda v: isinstance(v, float),
    "torch": lambda v: isinstance(v, torch.Tensor) and v.dtype == torch.uint8,
    "cuda": lambda v: isinstance(v, (list, tuple)) and all(
        isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in v),
}.items())


def check_rng_state(state: Any) -> None:
    """Checks that `restore_rng_state(state)` will succeed, without changing any RNG.

    Each state is tried on a fresh generator of its kind, so a state that any of them would
    refuse is found before the first live generator is set.

    Raises:
        ValueError: naming the first key that is missing or holds a value of the wrong kind.
    """
    if not isinstance(state, dict):
        raise ValueError(f"The RNG state must be a dict. Received: {type(state).__name__}.")
    for key, is_valid in _FIELDS:
        if key not in state and key != "cuda":
            raise ValueError(f"The RNG state has no {key!r}. It has: {sorted(map(str, state))[:12]}.")
        if key in state and not is_valid(state[key]):
            raise ValueError(f"The RNG state's {key!r} is not valid. Received: {short_repr(state[key])}.")
    for name, trial in (("python_state", lambda: random.Random().setstate(_python_state(state))),
                        ("numpy_keys", lambda: np.random.RandomState().set_state(_numpy_state(state))),
                        ("torch", lambda: torch.Generator().set_state(state["torch"])),
                        ("cuda", lambda: _try_cuda_states(state.get("cuda", ())))):
        try:
            trial()
        except Exception as err:  # each library raises its own kinds; all mean "refused"
            raise ValueError(f"The RNG state's {name!r} is refused: {str(err).splitlines()[0][:200]}") from None


def _try_cuda_states(states: Any) -> None:
    # Without an initialized CUDA, restoring is deferred by torch until CUDA starts: nothing to try.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for device, cuda_state in zip(range(torch.cuda.device_count()), states):
            torch.Generator(device=f"cuda:{device}").set_state(cuda_state)


def restore_rng_state(state: dict[str, Any]) -> None:
    """Puts every RNG back exactly where `capture_rng_state` found it (check it first: `check_rng_state`).

    CUDA states of devices this process does not see are left out.
    """
    random.setstate(_python_state(state))
    np.random.set_state(_numpy_state(state))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in zip(range(torch.cuda.device_count()), state["cuda"]):
            torch.cuda.set_rng_state(cuda_state, device)


#: Mixed into every derived state, so these seeds never coincide with a user's seeding scheme.
_DERIVATION_TAG = b"fittrain: RNG of a process added on resume, v1"


def derive_rank_state(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """The RNG states of process `rank`, one that the run which saved `state` (its process 0's)
    did not have: a resume on more processes than saved the checkpoint.

    A 32-byte seed is SHA-256 of a fixed tag, process 0's saved Python state (its 625 words),
    NumPy keys and position, torch CPU state, and `rank` (8 bytes, little-endian). Each generator
    gets its own key, SHA-256(seed + name): Python's `random` is seeded with key b"python" as one
    integer (little-endian), NumPy's global RNG with the eight 32-bit words of key b"numpy", torch's
    CPU generator with the first 8 bytes of key b"torch" (little-endian), and CUDA device d (when
    process 0 saved CUDA states) with the first 8 bytes of key b"cuda" + d (8 bytes), offset 0.
    (Separate keys, because Python and NumPy seeded from the same words draw the same numbers.)
    So the states depend only on the checkpoint and the rank: another resume from the same
    checkpoint on the same number of processes draws the same numbers, and no two ranks share one.

    Args:
        state: Process 0's saved states, as `capture_rng_state` returned them (checked).
        rank: The new process's rank.

    Returns:
        States in `capture_rng_state`'s format, ready for `restore_rng_state`.
    """
    digest = hashlib.sha256(_DERIVATION_TAG)
    for tensor in (state["python_state"], state["numpy_keys"], torch.tensor([state["numpy_pos"]]), state["torch"]):
        digest.update(tensor.contiguous().numpy().tobytes())
    digest.update(rank.to_bytes(8, "little"))
    seed = digest.digest()

    def key(name: bytes) -> bytes:
        return hashlib.sha256(seed + name).digest()

    version, words, gauss = random.Random(int.from_bytes(key(b"python"), "little")).getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.RandomState(
        np.frombuffer(key(b"numpy"), dtype="<u4")).get_state()
    derived: dict[str, Any] = {
        "python_version": version, "python_state": torch.tensor(words, dtype=torch.int64), "python_gauss": gauss,
        "numpy_kind": state["numpy_kind"], "numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_pos": int(np_pos), "numpy_has_gauss": int(np_has_gauss), "numpy_gauss": float(np_gauss),
        "torch": torch.Generator().manual_seed(int.from_bytes(key(b"torch")[:8], "little")).get_state(),
    }
    if "cuda" in state:
        derived["cuda"] = [_cuda_seed_state(key(b"cuda" + d.to_bytes(8, "little"))[:8])
                           for d in range(len(state["cuda"]))]
    return derived


def _cuda_seed_state(seed: bytes) -> torch.Tensor:
    # A CUDA generator's state is its 64-bit seed then its 64-bit Philox offset, in native (little-endian)
    # byte order (CUDAGeneratorImpl::get_state): what manual_seed(seed) leaves, without touching CUDA.
    return torch.frombuffer(bytearray(seed + bytes(8)), dtype=torch.uint8).clone()
