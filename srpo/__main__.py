"""``python -m srpo``: the ``srpo`` command (also ``torchrun --nproc_per_node N -m srpo train ...``)."""

from srpo.apps.cli import entry

if __name__ == "__main__":
    entry()
