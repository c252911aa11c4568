"""``python -m colossalai_exporter``: the same entry point as the console script."""

import sys

from colossalai_exporter.cli import main

sys.exit(main())
