"""`import fittrain.lightning as pl`: Lightning's names for drop-in ports, mapped onto fittrain's own classes.

(Being built: see issue 25, item 6.)
"""
