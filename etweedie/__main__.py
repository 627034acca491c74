"""``python -m etweedie``: the same command line as the ``etweedie`` console script."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
