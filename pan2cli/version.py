"""The package's version: one home that every module reads (hatch reads it too, for the wheel's metadata)."""

__version__ = "0.1.0"
