"""``python -m chaos``: one chaos run (see :mod:`chaos`); exit 0 only if the checker's zeros
hold, 1 if not, 2 for a ``CHAOS_*`` variable that cannot work."""

import sys

from chaos.run import main

sys.exit(main())
