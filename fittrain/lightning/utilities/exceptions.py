"""`lightning.pytorch.utilities.exceptions`' `MisconfigurationException`, for programs that raise it.

fittrain itself raises ValueError or TypeError for a misconfiguration (naming the argument, the
value and the fix), so `except MisconfigurationException` does not catch fittrain's own errors.
"""


class MisconfigurationException(Exception):
    """Lightning's exception for a wrong setting, raised by a program's own checks."""


__all__ = ["MisconfigurationException"]
