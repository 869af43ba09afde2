"""`fittrain.lightning.utilities`: the helpers Lightning programs import from `lightning.pytorch.utilities`.

    rank_zero_only, rank_zero_info, rank_zero_warn (rank_zero_debug)  rank_zero.py
    grad_norm                                                         grads.py
    types: STEP_OUTPUT, OptimizerLRScheduler, TRAIN_DATALOADERS, ...  types.py
    exceptions: MisconfigurationException                             exceptions.py

`rank_zero_only` asks for the rank at each call (the process group's, else the launcher's variables)
instead of keeping Lightning's `rank_zero_only.rank` attribute, so there is no module state to set.
Lightning's other utilities (CombinedLoader, measure_flops, ...) are not here: importing one fails
with Python's ImportError naming it.
"""

from fittrain.lightning.utilities import types
from fittrain.lightning.utilities.grads import grad_norm
from fittrain.lightning.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

__all__ = ["grad_norm", "rank_zero_info", "rank_zero_only", "rank_zero_warn", "types"]
