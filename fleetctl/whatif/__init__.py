"""What-if: a fleet's deployments simulated on a trace, the figures two fleets compare by, and
cost plans checked against each model's SLO."""
