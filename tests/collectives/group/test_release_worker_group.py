"""unison's exit release drops every handle it holds to the process group, whoever destroyed it.

gloo's threads end only when nothing references the ProcessGroup any more; one still
running while Python finalises may release a finished collective then and abort the
process (exit 134, "terminate called without an active exception"). A script that
destroys the default group itself used to leave unison's handles, and so gloo's threads,
alive into finalisation (issue 45 item B; ``benchmarks/stress_gloo_fallback_exit.py``).
"""

from __future__ import annotations

import pytest

from tests.collectives.group import _release_workers as w
from unison._testing import run_workers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_subgroups", [False, True])
def test_a_group_the_user_destroyed_leaves_no_gloo_thread_after_unisons_release(with_subgroups):
    for result in run_workers(w.user_destroys_then_unison_releases, 2, args=(with_subgroups,), timeout=90):
        assert result["fell_back"], result
        assert result["subgroups"] == (2 if with_subgroups else 0), result
        # The hazard is real: the user's destroy alone leaves gloo running while unison holds the group ...
        assert result["gloo_threads_after_user_destroy"] > 0, result
        # ... and the release ends it, subgroups included.
        assert result["handles_dropped"], result
        assert result["gloo_threads_after_release"] == 0, result
