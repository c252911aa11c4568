"""``python -m colossalai_exporter.slurm``: see :mod:`colossalai_exporter.slurm.cli`."""

import sys

from colossalai_exporter.slurm.cli import main

sys.exit(main())
