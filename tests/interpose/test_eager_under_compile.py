"""eager_under_compile: a table's forward runs eagerly under torch.compile, and importing it loads no Dynamo."""

import sys

import torch

from unison._interpose.eager_under_compile import eager_under_compile


def test_without_dynamo_loaded_the_function_is_called_as_it_is(monkeypatch):
    made = []
    monkeypatch.setattr(torch.compiler, "disable", lambda fn: made.append(fn) or fn)
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)  # nothing can be compiling
    calls = []

    @eager_under_compile
    def forward(x, scale=1):
        """The docstring stays."""
        calls.append(x)
        return x * scale

    assert forward(3, scale=2) == 6 and calls == [3] and made == []
    assert forward.__doc__ == "The docstring stays." and forward.__name__ == "forward"


def test_once_dynamo_is_loaded_the_function_runs_through_torch_compiler_disable_made_once(monkeypatch):
    import torch._dynamo  # noqa: F401 - loaded, as torch.compile loads it

    made = []

    def disable(fn):
        made.append(fn)
        return lambda *args, **kwargs: ("disabled", fn(*args, **kwargs))

    monkeypatch.setattr(torch.compiler, "disable", disable)

    @eager_under_compile
    def forward(x):
        return x + 1

    assert forward(1) == ("disabled", 2) and forward(5) == ("disabled", 6)
    assert len(made) == 1  # made at the first call, kept


def test_under_torch_compile_the_decorated_forward_is_not_traced():
    traced = []

    class Table(torch.nn.Module):
        @eager_under_compile
        def forward(self, ids):
            traced.append(torch.compiler.is_compiling())
            return torch.as_tensor(ids.tolist(), dtype=torch.float32)  # .tolist(): what Dynamo would break on

    table = Table()
    model = torch.compile(lambda ids: table(ids) * 2, backend="eager", fullgraph=False)
    assert torch.equal(model(torch.tensor([1, 2])), torch.tensor([2.0, 4.0]))
    assert traced and not any(traced)  # it ran, eagerly
