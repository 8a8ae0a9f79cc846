"""``python -m rdzv.server [options]``: the same as ``rdzv serve [options]``."""

import sys

from ..cli._serve import main

sys.exit(main())
