"""``python -m dptune.ledger``: the ``dptune ledger`` command (:mod:`dptune.cli.ledger`)."""

import sys

from dptune.cli.ledger import main

if __name__ == "__main__":
    sys.exit(main())
