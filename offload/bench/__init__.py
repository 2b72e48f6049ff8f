"""``offload-bench``: how fast the swap space moves data on your drives, and which aio settings to use.

Subcommands, one module each (see :mod:`offload.bench.cli`): ``io``, ``sweep``, ``adam``, ``checkpoint``,
``params``. Run ``offload-bench --help`` or ``python -m offload.bench --help``.
"""
