"""The KV agent: relays the engine's KV events as one resumable stream for routers.

``worker.agent.app.create_agent_app(AgentConfig(...))`` builds the aiohttp app.
"""
