"""What the benchmarks and the integration tests share: processes, readiness, stand-ins, load, results.

Imported as `harness` by a benchmark run as a script (`python benchmarks/NAME.py` puts
benchmarks/ first on sys.path) and as `benchmarks.harness` by the tests (`python -m pytest`
puts the repository root there); the modules import each other relatively, so both work.
It needs only the standard library and aiohttp (a fleetctl dependency), never fleetctl itself,
so a benchmark can drive a fleetctl from another checkout.
"""
