"""``python -m gym_fork`` runs the ``gym-fork`` command line (default: the demo)."""

import sys

from gym_fork.cli import main

sys.exit(main(sys.argv[1:] or ["demo"]))
