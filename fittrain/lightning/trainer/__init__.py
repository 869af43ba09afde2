"""`lightning.pytorch.trainer`'s names, at Lightning's module paths.

    Trainer                                    Lightning's arguments over the native Trainer   trainer.py
    TrainerFn, RunningStage, TrainerStatus     what trainer.state.fn/.stage/.status say          states.py
"""

from fittrain.lightning.trainer.trainer import Trainer

__all__ = ["Trainer"]
