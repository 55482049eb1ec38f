"""``python -m fedmf.cli …``: the same as the ``fedmf`` console script."""

import sys

from . import main

sys.exit(main())
