"""``python -m acco_ds.plan``: the ``acco-ds plan`` command (and ``--measure`` inside a launch)."""

import sys

from .command import main

sys.exit(main())
