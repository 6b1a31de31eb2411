"""route-serve, the routing daemon: HTTP intake, live server figures, the relay to backends,
replicas' shared state and the request log, around the pure core in fleetctl/routing/."""
