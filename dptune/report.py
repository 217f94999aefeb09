"""``python -m dptune.report``: the ``dptune report`` command, whose code is :mod:`dptune.cli.report`. Not a module to import:
``dptune.report`` stays the package attribute it is (an API function where there is one)."""

import sys

if __name__ == "__main__":
    from dptune.cli.report import main

    sys.exit(main())
raise ImportError("dptune/report.py only runs `python -m dptune.report`; import dptune.cli.report for the command")
