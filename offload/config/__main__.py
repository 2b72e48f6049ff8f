"""``python -m offload.config``: print the table of configuration keys (the README's), from their declarations."""

from .blocks import keys_table

print(keys_table(), end="")
