"""The package version; the build compiles it into the native extension (see offload/_native.py)."""

__version__ = "0.1.0"
