"""Session stores: ``sqlite-sessions`` (the embedded default)."""
