"""`fittrain.state`: Accelerate's `accelerate.state` module name, re-exporting.

`from accelerate.state import PartialState` becomes `from fittrain.state import PartialState`. The
implementations live in their layers: `PartialState` and `AcceleratorState` in
`fittrain.accelerator.partial_state`, `GradientState` in `fittrain.distributed.gradient_state`, the
process facts in `fittrain.distributed.process_state`.
"""

from fittrain.accelerator.partial_state import AcceleratorState, PartialState
from fittrain.distributed.gradient_state import GradientState
from fittrain.distributed.process_state import DistributedType

__all__ = ["AcceleratorState", "DistributedType", "GradientState", "PartialState"]
