"""``python -m cannjax``: see :mod:`cannjax.cli`."""

import sys

from cannjax.cli import main

if __name__ == "__main__":
    sys.exit(main())
