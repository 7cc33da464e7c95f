"""The Python client (sdk): the client, the agent loop, adapters, examples."""
