"""The version of rdzv, in one place."""

__version__ = "0.1.0"
