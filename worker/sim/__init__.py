"""A GPU-free stand-in for a vLLM v1 engine, faithful enough that a 2-core machine can run
a 16-worker fleet and the real router against it.

Same HTTP API, metric names and KV event wire format as vLLM 0.32, a paged block pool
with vLLM's exact prefix-caching semantics, a continuous-batching scheduler with
chunked prefill and preemption, and a timing model for a named GPU and model.

Layout (pure logic first, I/O last):

- ``engine_hashing``: the engine's own chained block hashes (vLLM-style, sha256).
- ``request``: per-request token and block-hash state.
- ``block_pool``: blocks, free queue in eviction order, prefix cache, event queue.
- ``kv_manager``: per-request block tables (vLLM's KVCacheManager, one group).
- ``scheduler``: vLLM v1's FCFS scheduler: budget, chunked prefill, preemption.
- ``timing``: per-step time from a roofline of a named GPU and model.
- ``engine``: the asyncio loop that runs steps in (scaled) real time.
- ``events``: ZMQ PUB + replay ROUTER, like vLLM's ZmqEventPublisher.
- ``openai_protocol``, ``tokenizer``, ``serving``, ``metrics``, ``server``: the HTTP
  side (``server.SimConfig`` and ``server.create_sim_app`` are the entry points).
- ``__main__``: ``python -m worker.sim``; ``bench``: the fleet benchmark.
"""
