"""``python -m srpo``: the ``srpo`` command (also ``torchrun --nproc_per_node N -m srpo train ...``)."""

import sys

from srpo.apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
