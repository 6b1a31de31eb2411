"""`python -m fleetctl` runs the command line."""

from fleetctl.cli import main

main()
