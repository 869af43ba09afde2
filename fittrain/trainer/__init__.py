"""The Trainer layer: a training loop on the Accelerator that fires lifecycle events.

Holds:
    trainer         `Trainer`: fit (the epoch and batch loop, on one screen), validate, test, predict
    train_state     `TrainState`: where training stands, saved in every checkpoint
    module          `TrainModule`, what users subclass
    hparams         `save_hyperparameters` and `hparams` (the module's and the datamodules')
    module_hooks    the module's own hooks under Lightning's names (`LifecycleHooks`), checked and
                    bound once per fit; they run before the callbacks' at each event
    events          the `Event`s and their order (its docstring is the loop), the `Callback` base
                    class with `run_request` (what a callback asks of the run), the dispatcher
    optimization    `AutomaticOptimization` and the choice of mode; both modes have one `train_batch`
    manual          `ManualOptimization`: training_step steps its own optimizers (Lightning's names)
    configure       the one parser of `configure_optimizers`, for both modes
    schedules       when the LR scheduler steps (`Schedule` objects called at the loop's fixed points)
    logged          `MetricLog`: self.log's options (on_step/on_epoch, reduce_fx, sync_dist, prog_bar, logger)
    metric_objects  torchmetrics `Metric`s given to self.log: Lightning's values and resets, states in checkpoints
    monitor         `Monitor`: a watched metric, its mode and best value (EarlyStop, Checkpointer,
                    plateau schedules)
    evaluation      `Evaluation`: the validation, test and predict loops, returning their results
    ckpt_path       `validate/test/predict(ckpt_path=...)`: the checkpoint an evaluation restores first
    limits          `LoopLimits`: limit_*_batches, overfit_batches, fast_dev_run; a limited epoch's batches
    loop_plan       `LoopPlan`: how long fit trains, the batches each loop runs (`num_*_batches`)
    validation_schedule  when fit validates: at epoch ends, or after optimizer steps (int or fraction)
    sanity          the sanity check before training (`num_sanity_val_steps`)
    timer           `max_time`: stop once that much time has trained
    summary         `summarize`: the parameter table printed when fit starts (`enable_model_summary`)
    determinism     `deterministic`: torch's deterministic algorithms
    parts           small pieces of the loop: argument checks, loss extraction, `StepRunner`,
                    metric bookkeeping
    preempt         on a preemption signal: finish the step, save, exit 75
    runs            the fit's run: its name, its folder, the checkpoint a resume loads, its hparams
    datamodule      `DataModule` (Lightning's LightningDataModule): prepare_data, setup(stage), the loaders
    progress        `ProgressBar`, the default display (`enable_progress_bar`); fittrain.callbacks exports it
    callback_states all callbacks' states as one checkpointed object

May import: `fittrain.accelerator` and everything below it (step, data, checkpoint, trackers,
distributed, common). Nothing below imports this package, and it never imports `fittrain.callbacks`:
callbacks depend on it, and tell it what they need through `Callback.run_request`.
"""
