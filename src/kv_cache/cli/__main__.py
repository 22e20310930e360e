"""``python -m kv_cache.cli``: the ``kvcache`` command."""

import sys

from .main import main

sys.exit(main())
