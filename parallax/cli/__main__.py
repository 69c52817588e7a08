"""``python -m parallax.cli``: the ``parallax`` command where its script is not on PATH."""

import sys

from parallax.cli.main import main

sys.exit(main())
