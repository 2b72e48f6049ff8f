"""``python -m offload.tools``: the same as the ``offload-bench`` console script."""

import sys

from .cli import main

sys.exit(main())
