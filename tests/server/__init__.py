"""The server (agentrt): routes, OpenAI / Responses / Anthropic APIs, persistence, auth, scale-out, CLI."""
