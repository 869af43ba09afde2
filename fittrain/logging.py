"""`fittrain.logging`: Accelerate's `accelerate.logging` module name, re-exporting.

`from accelerate.logging import get_logger` becomes `from fittrain.logging import get_logger`.
The implementation is `fittrain.accelerator.process_logging`. (fittrain's own modules use absolute imports,
so `import logging` inside the package is always the standard library's, never this module.)
"""

from fittrain.accelerator.process_logging import LOG_LEVEL_ENV, MultiProcessAdapter, get_logger

__all__ = ["LOG_LEVEL_ENV", "MultiProcessAdapter", "get_logger"]
