"""``python -m meshlm <command> ...``: the ``meshlm`` command, e.g. ``python -m meshlm train
key=value ...``, the form to give torchrun (``torchrun ... -m meshlm train ...``)."""

import sys

from meshlm.cli import main

if __name__ == "__main__":
    sys.exit(main())
