"""``offload-bench``: how fast the swap space moves data on your drives, and which aio settings to use.

Subcommands, one module each (see :mod:`offload.bench.cli`): ``io`` (``--gds``: :mod:`.gds`), ``sweep``, ``adam``,
``checkpoint``, ``params``, ``gpu``. Run ``offload-bench --help`` or ``python -m offload.bench --help``.
"""
