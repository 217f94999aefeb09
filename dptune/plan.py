"""``python -m dptune.plan``: the ``dptune plan`` command, whose code is :mod:`dptune.cli.plan`. Not a module to import:
``dptune.plan`` stays the package attribute it is (an API function where there is one)."""

import sys

if __name__ == "__main__":
    from dptune.cli.plan import main

    sys.exit(main())
raise ImportError("dptune/plan.py only runs `python -m dptune.plan`; import dptune.cli.plan for the command")
