"""``python -m reshard.store.cli``."""

import sys

from .app import main

sys.exit(main())
