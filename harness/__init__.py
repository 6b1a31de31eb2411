"""What the benchmarks and the integration tests share: processes, readiness, stand-ins, load,
results, SSH test hosts in network namespaces and a recorded nvidia-smi.

One place for both, so neither imports the other: `import harness` finds it at the
repository's root (the developer install, `pip install -e .`, puts the root on sys.path;
pytest does too). The modules import each other relatively. It needs only the standard
library and aiohttp (a fleetctl dependency), never fleetctl itself, so a benchmark can drive
a fleetctl from another checkout.
"""
