"""A plugin module that fails to import with an exception whose ``str()`` itself raises."""


class Unprintable(Exception):
    """An error whose message needs an attribute the code that raised it never set."""

    def __str__(self) -> str:
        return f"bad field {self.field}"  # type: ignore[attr-defined]


raise Unprintable()
