"""The swap space: aligned extents striped over one preallocated, locked swap file per drive.

``extents`` keeps the books, ``files`` creates, locks and cleans up swap files, ``paths`` checks the
directories, ``fileset`` holds a space's engines and files and sizes them together, and ``swap`` holds
:class:`SwapSpace`, which moves extents through the engine.
"""

from .extents import Extent, ExtentAllocator
from .swap import SwapSpace

__all__ = ["Extent", "ExtentAllocator", "SwapSpace"]
