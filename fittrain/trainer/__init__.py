"""The Trainer layer: a training loop on the Accelerator that fires lifecycle events.

Holds:
    trainer         `Trainer` and `TrainState`: fit, validate, test, predict
    module          `TrainModule`, what users subclass
    events          the `Event`s, their order, the `Callback` base class and the dispatcher
    evaluation      validation, test and predict loops
    manual, manual_config, schedules
                    optimization modes and when schedulers step
    parts, runs, callback_states
                    argument checks and metrics, run folders, callbacks' saved states

May import: `fittrain.accelerator` and everything below it. Nothing below imports this package.
"""
