"""Processes and how they cooperate: everything that knows about torch.distributed.

Holds:
    process_state     rank, world size and device from torchrun's (or SLURM's) environment
    gradient_state    gradient-accumulation bookkeeping (Accelerate's `GradientState`)
    collectives       gather, reduce, broadcast over nested structures of tensors
    process_methods   `ProcessHelpers`: the process methods `PartialState` and the Accelerator share
    strategies/       `Strategy` (one process), `DDPStrategy`, `FSDP2Strategy`: how models are wrapped,
                      synchronised, clipped and saved (full or sharded state); `make_strategy`
    parallel          strategy names ("auto", "ddp", "fsdp") and which one a run uses
    layout            `ParallelismConfig` (Accelerate's): the processes on a device mesh (HSDP: 2-D)
    memory_estimate   each process's bytes of parameters, gradients, optimizer state under a layout
    wrappers          what a prepared model is wrapped in (DDP, FSDP2, torch.compile); `unwrap`
    sharded_state     sharded state dicts (torch.distributed.checkpoint), for the strategies
    slurm, teardown, preemption, launch_guard, watchdog
                      the job around the processes: SLURM's environment, a clean exit,
                      graceful preemption, dying with the launcher, ending a job whose rank hangs

The strategies are the only place that asks whether a model runs under DDP or FSDP2; code
above this package asks the Accelerator's strategy object instead.

May import: `fittrain.common` only.
"""
