"""``python -m irdmafs``: the ``irdmafs`` command (launch/cli.py)."""

from .launch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
