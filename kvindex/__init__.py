"""kvindex: pure logic for the global prefix index (no I/O, no asyncio).

- ``kvindex.protocol``: vLLM KV event wire structs, their decoder, ZMQ frame helpers;
- ``kvindex.agent_protocol``: the agent stream's wire structs;
- ``kvindex.sequence``: seq tracking of an engine's event feed (gap, duplicate, restart);
- ``kvindex.hashing``: namespaced chained block hashes;
- ``kvindex.index``: the prefix index of which worker holds which blocks, built on
  ``block_map`` (the maps and their invariants), ``index_predictions`` (predicted
  blocks), ``index_walk`` (the lookup walk) and ``index_types`` (values, ``Index``).
"""
