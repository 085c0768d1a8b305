"""The ``hvd-compress`` command: ``hvd-compress bench <benchmark> [options]`` runs what
``python -m hvd_compress.bench <benchmark> [options]`` runs."""
import sys

from hvd_compress.bench.__main__ import main as bench


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "bench":
        print("usage: hvd-compress bench <benchmark> [options]   ('hvd-compress bench' lists them)",
              file=sys.stderr)
        return 2
    return bench(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
