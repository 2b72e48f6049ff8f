"""What users run: the command lines, the benchmarks and the demo, above every other layer.

- ``offload-bench`` (:mod:`.cli`, ``python -m offload.tools``): how fast the swap space moves data on your drives
  and which aio settings to use; one module per subcommand: ``io`` (``--gds``: :mod:`.gds`), ``sweep``, ``adam``,
  ``checkpoint``, ``params``, ``compare`` (with the bytes :mod:`.ledger`), ``quality``, ``plan``, ``gpu``.
- ``offload-report`` (:mod:`.doctor`, :mod:`.report`): what this machine and a configuration will do.
- ``offload-ckpt`` (:mod:`.ckpt_cli`): inspect, verify, list, export, import and mirror checkpoints.
- ``offload-swap`` (:mod:`.swap_cli`): the swap files left on a drive.
- ``make demo`` (:mod:`.demo`).
"""
