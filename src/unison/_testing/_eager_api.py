"""Imports every public name of unison now (``unison`` itself loads them on first use).

The test fork server preloads this module, so that the workers it forks start with
unison's strategies, collectives and checkpointing already imported, as they did when
``import unison`` imported everything.
"""

import unison

for _name in unison.__all__:
    getattr(unison, _name)
