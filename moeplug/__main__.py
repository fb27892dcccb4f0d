"""``python -m moeplug`` is the ``moeplug`` console script."""

import sys

from moeplug.cli import main

sys.exit(main())
