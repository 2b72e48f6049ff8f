"""The one owner of offloaded bytes: extents, checked reads, landing of writes, failures and the host tier.

The optimizer's state (``offload.state``), the offloaded weights and their grads (``offload.params``)
are built on it; none of them keeps its own copy of these rules.
"""

from .core import ByteStore, Stored
from .tier import HostTier, TierSource, auto_cache_bytes

__all__ = ["ByteStore", "HostTier", "Stored", "TierSource", "auto_cache_bytes"]
