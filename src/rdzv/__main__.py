"""``python -m rdzv``: the same as the ``rdzv`` command."""

import sys

from .cli import main

sys.exit(main())
