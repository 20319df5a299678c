"""``python -m cannjax``: see :mod:`cannjax._src.cli`."""

import sys

from cannjax._src.cli import main

if __name__ == "__main__":
    sys.exit(main())
