"""The schema's revisions, one file each, which Alembic loads by path (it skips this file)."""

__all__: list[str] = []
