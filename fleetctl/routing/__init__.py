"""The pure routing core: requests, backends, policies, the admission scheduler and sessions.

No I/O and no event loop: the simulator (fleetctl/sim/) and the daemon (fleetctl/daemon/)
call the same code.
"""
