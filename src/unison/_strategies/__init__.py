"""The strategies, their shared ``StrategyExtended`` semantics and the components they are built from."""

__all__: list[str] = []  # nothing here: import the submodules (the public names are re-exported by ``unison``)
