"""What fleetctl knows of vLLM itself: its releases' rules, flags, /metrics series and block
hashes (read from vLLM's sources and captured output; fleetctl never imports vLLM)."""
