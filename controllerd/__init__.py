"""controllerd: splits, merges and garbage-collects the segments of scalable topics."""

__version__ = "0.1.0"
