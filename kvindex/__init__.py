"""kvindex: pure logic for the global prefix index (no I/O, no asyncio).

- ``kvindex.protocol``: vLLM KV event wire structs and their decoder;
- ``kvindex.hashing``: namespaced chained block hashes;
- ``kvindex.index``: the prefix index of which worker holds which blocks.
"""
