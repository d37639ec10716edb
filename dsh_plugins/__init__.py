"""The built-in dsh plugins, each found through the dsh.plugins entry-point group."""
