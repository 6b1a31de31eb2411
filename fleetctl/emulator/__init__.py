"""`fleetctl emulate`: one vLLM OpenAI-compatible server, its GPU modelled by the sim Engine.

args.py parses `vllm serve`'s flags, config.py resolves them against the profiles and the
performance model, driver.py runs the Engine in real time, protocol.py and server.py speak
vLLM's HTTP API, metrics.py writes its Prometheus exposition.

Prefix caching (vLLM V1's automatic prefix caching, on unless --no-enable-prefix-caching):
prompts.py names each prompt's blocks for the engine's cache, without a tokenizer. Token-id
prompts: their full 16-token blocks hashed as vLLM 0.32 hashes them (fleetctl/vllm/hashing.py,
--prefix-caching-hash-algo, $PYTHONHASHSEED). Text (a completions prompt, or a chat's message
contents joined by newlines as the router's prompt_text joins them): fixed 64-character
chunks chained (fleetctl/routing/blocks.py text_blocks), each 16 tokens at the emulator's 4
characters per token. Hits show in vllm:prefix_cache_queries_total / _hits_total.

KV events: with --kv-events-config (vLLM's JSON), kv_events.py publishes the engine's stored
and evicted blocks on ZMQ in vLLM 0.32's wire format, with its replay socket.
"""
