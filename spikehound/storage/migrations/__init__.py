"""Alembic's environment (``env.py``) and the schema's revisions (``versions/``), run through
``spikehound.storage.migrate``; nothing imports them."""

__all__: list[str] = []
