"""The examples in unison.placement's docstrings, and in the ps placement it re-exports, run and print what they
show."""

from __future__ import annotations

import doctest

import pytest

from unison._placement import config, parameter_servers, strategies
from unison._ps.remote_variables import name_placement as ps_placement


@pytest.mark.parametrize("module", [config, parameter_servers, strategies, ps_placement], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
