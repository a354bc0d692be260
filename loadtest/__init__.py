"""kvroute: loadtest. Every claim is a side-by-side measurement on the same workload.

- ``workloads/``: deterministic request generators (Mooncake trace replay, tenants,
  multi-turn chat, RAG, agent fan-out); prompts are token ids.
- ``client``: open-loop streaming client (TTFT, TPOT, e2e, cached tokens, worker).
- ``ceiling``: the hit-ratio ceiling of a workload (one LRU cache, fleet capacity).
- ``stats`` / ``report``: summaries, Markdown table, PNG plots, JSON.
- ``fleet``: router + N workers as child process groups on loopback.
- ``compare`` (``kvroute loadtest``), ``demo`` (``kvroute demo``), ``up`` (``kvroute up``),
  ``sweep`` (``kvroute sweep``): the commands.
"""
