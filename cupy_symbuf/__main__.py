"""``python -m cupy_symbuf info [--json] [--no-communicator]``: see :func:`cupy_symbuf.info`. (The benchmark is
``python -m cupy_symbuf.bench``.)"""
import sys


def _main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "info":
        from .diagnostics.info import main
        return main(argv[1:])
    print(f"python -m cupy_symbuf: unknown command {argv[0]!r}; known: info (benchmarks: python -m cupy_symbuf.bench)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main())
