"""A plugin module that fails to import."""

raise ImportError("this plugin is broken on purpose")
