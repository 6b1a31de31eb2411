"""The autopilot: the fleet follows its traffic (forecasts, re-plans, sleeps and wakes)."""
