"""``python -m elesium.cli``: the same as the ``elesium`` command."""

import sys

from elesium.cli import main

sys.exit(main())
