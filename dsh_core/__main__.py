"""``python -m dsh_core`` runs the ``dsh`` command."""

from dsh_core.cli import main

main()
