"""Small helpers every layer may use: nothing here imports another part of fittrain.

Holds:
    reprs          `short_repr`: a received value, shortened, for error messages
    availability   Accelerate's `is_*_available`: installed packages and present devices

May import: nothing from fittrain.
"""
