"""``python -m dptune.search``: the ``dptune search`` command, whose code is :mod:`dptune.cli.search`. Not a module to import:
``dptune.search`` stays the package attribute it is (an API function where there is one)."""

import sys

if __name__ == "__main__":
    from dptune.cli.search import main

    sys.exit(main())
raise ImportError("dptune/search.py only runs `python -m dptune.search`; import dptune.cli.search for the command")
