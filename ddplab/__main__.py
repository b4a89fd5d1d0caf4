"""Command line: ``python -m ddplab`` (filled in by ddplab.cli)."""
import sys


def main(argv=None) -> int:
    from ddplab.cli import main as cli_main
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
