"""``python -m kvpage ...``: the same commands as the ``kvpage`` script."""

import sys

from kvpage.entrypoints.cli import main

sys.exit(main())
