"""``python -m hvd_compress.advise``: see the package's docstring."""

from hvd_compress.advise.cli import main

if __name__ == "__main__":
    main()
