"""``python -m specdec.cli.bench``: the same as ``specdec bench-engine``."""

import sys

from specdec.cli.bench import main

sys.exit(main())
