"""Distributed values and variables."""

__all__: list[str] = []  # nothing here: import the submodules (the public names are re-exported by ``unison``)
