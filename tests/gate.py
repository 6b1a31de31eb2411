"""`python gate.py FILE -- CMD...`: wait until FILE exists, then exec CMD in this process.

A test's stand-in for a server that is still loading, for as long as the test wants: the pid
stays the same across the exec, so pid files and process listings stay true, and no child
process is forked while it waits. The test opens the gate by creating FILE.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    path, sep, *argv = sys.argv[1:]
    if sep != "--" or not argv:
        sys.exit("usage: gate.py FILE -- CMD...")
    while not os.path.exists(path):
        time.sleep(0.02)
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
