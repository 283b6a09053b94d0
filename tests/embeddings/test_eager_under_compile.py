"""``eager_under_compile``: ``torch.compiler.disable`` for the table modules, without importing Dynamo
until something compiles."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch._dynamo
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch._dynamo.utils import counters

from unison._interpose.eager_under_compile import eager_under_compile


@pytest.mark.timeout(120)
def test_a_recommendation_job_trains_and_serves_without_importing_dynamo():
    code = (
        "import sys, torch, unison, unison.embeddings as e\n"
        "e.ServingEmbedding, unison.HybridParameterServerStrategy\n"
        "emb = unison.DynamicEmbedding(4, mode='sum', seed=1)\n"
        "emb(torch.tensor([[1, 2], [3, 4]])).sum().backward()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]  # torch.compiler.disable imports it: 1.5 s of a worker's start


_SEEN: list[bool] = []  # per call of _inner: whether Dynamo traced it or could catch its frames


def _inner(x):
    # traced: True; run eagerly: False; and with no Dynamo callback left to catch its frames
    _SEEN.append(torch.compiler.is_compiling() or get_eval_frame_callback() is not None)
    return x.numpy().sum() + x  # numpy on a tensor: Dynamo would have to graph-break inside


# Decorated at import, as the table modules' methods are: Dynamo's resets come after.
_OURS, _TORCHS = eager_under_compile(_inner), torch.compiler.disable(_inner)


def _compiled_run(inner):
    """Compiles a function around ``inner``; returns what Dynamo did and what each call saw."""
    def outer(x):
        return torch.sin(inner(torch.cos(x)) * 2)

    torch._dynamo.reset()
    counters.clear()
    _SEEN.clear()
    compiled = torch.compile(outer, backend="eager")
    x = torch.arange(4.0)
    results = [compiled(x), compiled(x + 1)]
    seen = list(_SEEN)
    breaks = {reason.split("\n")[0]: count for reason, count in counters["graph_break"].items()}
    return results, [outer(x), outer(x + 1)], seen, breaks, dict(counters["frames"]), dict(counters["stats"])


def test_under_torch_compile_it_breaks_the_graph_and_runs_eagerly_as_torch_compiler_disable():
    for _ in range(2):  # and again after Dynamo's reset
        got, want, seen, breaks, frames, stats = _compiled_run(_OURS)
        _, _, seen_t, breaks_t, frames_t, stats_t = _compiled_run(_TORCHS)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert seen == seen_t == [False, False]  # the compiled calls ran it eagerly, Dynamo off
        # one graph break each, at the disabled call (Dynamo words it "Skip inlining" for ours, a
        # Python function, and "Skip calling" for torch's wrapper, whose code it skips by file)
        assert sum(breaks.values()) == sum(breaks_t.values()) == 1, (breaks, breaks_t)
        assert all(reason.endswith("`torch.compiler.disable()`d function") for reason in [*breaks, *breaks_t])
        assert frames == frames_t and stats == stats_t  # no frame of the wrapper traced


def test_it_returns_the_function_itself_so_an_eager_call_costs_nothing_more():
    def lookup(x):
        """Rows."""
        return x

    assert eager_under_compile(lookup) is lookup and lookup(3) == 3
