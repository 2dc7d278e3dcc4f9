"""``python -m trainhist``: the ``trainhist`` command (:mod:`trainhist.cli`), for an environment without the console
script on its PATH."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
