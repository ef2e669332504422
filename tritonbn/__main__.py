"""``python -m tritonbn``: the ``tritonbn`` command (see :mod:`tritonbn.cli`)."""

import sys

from tritonbn.cli import main

if __name__ == "__main__":
    sys.exit(main())
