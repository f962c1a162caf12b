"""The ``cohort`` command that the wheel installs: the ``cohort`` binary's
command line (every command, flag and message), run by the extension."""

import sys

from . import _cohort


def main() -> int:
    """``cohort …`` from a shell; the command's exit code."""
    return _cohort.command_line(sys.argv)


if __name__ == "__main__":
    sys.exit(main())
