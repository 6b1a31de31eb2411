"""`fleetctl emulate`: one vLLM OpenAI-compatible server, its GPU modelled by the sim Engine.

args.py parses `vllm serve`'s flags, config.py resolves them against the profiles and the
performance model, driver.py runs the Engine in real time, protocol.py and server.py speak
vLLM's HTTP API, metrics.py writes its Prometheus exposition.
"""
