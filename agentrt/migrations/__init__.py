"""Alembic migrations of the server's schema (agentrt.models); run by agentrt.db.open_database on start."""
