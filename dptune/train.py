"""``python -m dptune.train``: the ``dptune train`` command, whose code is :mod:`dptune.cli.train`. Not a module to import:
``dptune.train`` stays the package attribute it is (an API function where there is one)."""

import sys

if __name__ == "__main__":
    from dptune.cli.train import main

    sys.exit(main())
raise ImportError("dptune/train.py only runs `python -m dptune.train`; import dptune.cli.train for the command")
