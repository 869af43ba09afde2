"""Processes and how they cooperate: everything that knows about torch.distributed.

Holds:
    process_state     rank, world size and device from torchrun's (or SLURM's) environment
    gradient_state    gradient-accumulation bookkeeping (Accelerate's `GradientState`)
    collectives       gather, reduce, broadcast over nested structures of tensors
    process_methods   `ProcessHelpers`: the process methods `PartialState` and the Accelerator share
    parallel          the strategies that wrap a model for DDP or FSDP2
    sharded_state     sharded state dicts of prepared models and optimizers
    slurm, teardown, preemption, launch_guard
                      the job around the processes: SLURM's environment, a clean exit,
                      graceful preemption, dying with the launcher

May import: `fittrain.common` only.
"""
