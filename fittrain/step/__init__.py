"""The per-step path: what runs between a batch and an optimizer step.

Holds:
    precision   autocast and loss scaling behind one interface
    optim       the prepared optimizer and scheduler, which respect gradient accumulation
    compile     torch.compile for prepared models (which modules to compile is the strategy's to say)

May import: `fittrain.distributed`, `fittrain.common`.
"""
