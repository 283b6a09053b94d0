"""``import unison.partitioners``: tf.distribute.experimental.partitioners' spelling of ``unison.ps.partitioners``.

The module replaces itself with ``unison.ps.partitioners``, so both names are one module.
"""

import sys

from unison.ps import partitioners

sys.modules[__name__] = partitioners
