"""``python -m optmem``."""

import sys

from optmem.cli import main

sys.exit(main())
