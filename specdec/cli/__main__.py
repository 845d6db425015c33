"""``python -m specdec.cli``: the ``specdec`` command."""

import sys

from specdec.cli import main

sys.exit(main())
