"""tensorpack's ``graph_builder/utils.py`` helpers that unison's CrossDeviceOps are not built from.

``placement.py``: least-loaded placement of variables (``LeastLoadedDeviceSetter``, which
the parameter-server strategy uses as ``variable_placer="least_loaded"``);
``tensorpack.py``: the rest, kept for code ported from tensorpack. Both are reached
through ``unison._collectives``, which re-exports their public names: no other module
imports this package (``tests/architecture/test_layers.py``).
"""

__all__: list[str] = []
