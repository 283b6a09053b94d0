"""What unison changes in PyTorch lives in ``unison._interpose``, listed in one literal tuple;
importing changes nothing.

Every change (hooks, wrapped methods, a replaced ``__deepcopy__``, a mode pushed for a
block, an attribute replaced on a user's optimizer or module) is an ``Interposition``,
``ScopedInterposition`` or ``InstanceInterposition`` defined in ``unison._interpose`` and
listed in ``unison._interpose.every_change.INTERPOSITIONS``, installed on first use. A
fresh interpreter that imports every unison module must find torch as it was; one that
builds a model in a multi-replica scope and steps it finds the changes installed. No
module outside ``unison._interpose`` changes torch's classes, global hooks, or the
methods and internal dicts of a torch object it was handed, or reads the private torch
functions ``_interpose/torch_private.py`` names.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

_PROBE = textwrap.dedent('''
    import importlib, json, pkgutil, sys
    import torch
    from torch import nn
    from torch.amp import grad_scaler
    from torch.nn.modules import module as torch_module
    from torch.optim import optimizer as torch_optimizer
    originals = {"Parameter.__deepcopy__": nn.Parameter.__deepcopy__, "GradScaler.step": grad_scaler.GradScaler.step,
                 "Optimizer.state_dict": torch.optim.Optimizer.state_dict}

    def torch_state():
        return {
            "parameter_hooks": len(torch_module._global_parameter_registration_hooks),
            "buffer_hooks": len(torch_module._global_buffer_registration_hooks),
            "step_pre_hooks": len(torch_optimizer._global_optimizer_pre_hooks),
            "step_post_hooks": len(torch_optimizer._global_optimizer_post_hooks),
            "patched": sorted(name for name, original in originals.items()
                              if {"Parameter.__deepcopy__": nn.Parameter.__deepcopy__,
                                  "GradScaler.step": grad_scaler.GradScaler.step,
                                  "Optimizer.state_dict": torch.optim.Optimizer.state_dict}[name] is not original),
        }

    import unison
    for info in pkgutil.walk_packages(unison.__path__, "unison."):
        if "_testing" not in info.name and not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    from unison._interpose.every_change import INTERPOSITIONS
    report = {"after_import": torch_state(),
              "registry": [[i.what, i.target, i.why, i.installed] for i in INTERPOSITIONS]}
    if sys.argv[1] == "use":
        strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            model = nn.Linear(3, 2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        def step(x):
            opt.zero_grad(); model(x).sum().backward(); opt.step()
        strategy.run(step, args=(unison.PerReplica([torch.ones(2, 3), torch.ones(2, 3)]),))
        report["after_use"] = torch_state()
        report["installed"] = sorted(i.what for i in INTERPOSITIONS if i.installed)
    print(json.dumps(report))
''')


def _probe(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_every_module_changes_nothing_in_torch_and_lists_every_change():
    report = _probe("import")
    assert report["after_import"] == {"parameter_hooks": 0, "buffer_hooks": 0, "step_pre_hooks": 0,
                                      "step_post_hooks": 0, "patched": []}
    registry = report["registry"]
    assert len(registry) == 11, registry
    for what, target, why, installed in registry:
        assert what and target and why and not installed, (what, target, why, installed)


def test_using_a_strategy_installs_its_changes():
    report = _probe("use")
    assert report["after_use"]["parameter_hooks"] == report["after_use"]["buffer_hooks"] == 1
    assert report["after_use"]["step_pre_hooks"] == report["after_use"]["step_post_hooks"] == 1
    assert report["after_use"]["patched"] == ["GradScaler.step", "Parameter.__deepcopy__"]
    assert report["installed"] == sorted([
        "global module parameter/buffer registration hooks",
        "one global optimizer step pre-hook, dispatching to the owners that act at opt.step()",
        "a global optimizer step post-hook, once some optimizer's plan has work after its step",
        "an optimizer's own zero_grad, without a dispatch per parameter inside a replica",
        "a module's _parameters and _buffers dicts answering a replica with its component",
        "nn.Parameter.__deepcopy__", "GradScaler.step/update and a per-replica state property",
        "once-per-step wrappers of step / update_parameters / add_param_group, and __init_subclass__",
    ])


_SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "unison"
_INTERPOSE = _SRC / "_interpose"


def _modules_outside_interpose() -> list[pathlib.Path]:
    return [path for path in sorted(_SRC.rglob("*.py")) if _INTERPOSE not in path.parents]


def test_the_list_is_a_literal_tuple_of_every_interposition_the_interpose_modules_define():
    import importlib
    import pkgutil

    import unison._interpose
    from unison._interpose import registry
    from unison._interpose.every_change import INTERPOSITIONS

    kinds = (registry.Interposition, registry.ScopedInterposition, registry.InstanceInterposition)
    defined = {}
    for info in pkgutil.iter_modules(unison._interpose.__path__, "unison._interpose."):
        module = importlib.import_module(info.name)
        defined.update({f"{info.name}.{name}": value for name, value in vars(module).items()
                        if isinstance(value, kinds) and name in getattr(module, "__all__", [name])})
    listed = {id(change) for change in INTERPOSITIONS}
    assert len(listed) == len(INTERPOSITIONS), "listed twice"
    assert {name for name, change in defined.items() if id(change) not in listed} == set()
    assert len(defined) == len(INTERPOSITIONS)
    tree = ast.parse((_INTERPOSE / "every_change.py").read_text())
    (value,) = [node.value for node in tree.body if isinstance(node, ast.AnnAssign)
                and getattr(node.target, "id", None) == "INTERPOSITIONS"]
    assert isinstance(value, ast.Tuple) and all(isinstance(item, ast.Attribute) for item in value.elts), (
        "INTERPOSITIONS is a literal tuple of module.attribute names: a reader sees every change in one place")
    constructors = [node for node in ast.walk(ast.parse((_INTERPOSE / "registry.py").read_text()))
                    if isinstance(node, ast.Attribute) and node.attr == "append"]
    assert not constructors, "the registry does not fill itself from constructors"


def test_every_interposition_is_defined_in_the_interpose_package():
    defined_outside = []
    for path in _modules_outside_interpose():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call)
                    and getattr(node.func, "id", None) in ("Interposition", "ScopedInterposition")):
                defined_outside.append(f"{path.relative_to(_SRC)}:{node.lineno}")
    assert not defined_outside, f"interpositions defined outside unison/_interpose: {defined_outside}"


# What changes torch for everyone: global hooks, class attributes assigned, the private
# functions named once in _interpose/torch_private.py.
_TORCH_CHANGES = re.compile(
    r"register_module_(module|parameter|buffer)_registration_hook|register_optimizer_step_(pre|post)_hook"
    r"|setattr\((torch|nn)\.|^\s*(torch|nn)\.[\w.]+\s*=[^=]"
    r"|_C\._\w+|_utils\._\w+\(|import _unflatten|_execution_engine|TensorBase\._use_count"
    r"|TorchFunctionMode|_pop_mode_temporarily", re.MULTILINE)


# What changes one torch object the user handed over: its methods or internal dicts
# assigned, or its instance dict written, on a receiver that is not the code's own (self).
_INSTANCE_CHANGES = re.compile(
    r"^\s*(?!self\.|cls\.)[A-Za-z_]\w*(\.\w+)*\.(zero_grad|step|forward|backward|state_dict|load_state_dict"
    r"|_parameters|_buffers|_modules|_forward_hooks|_forward_pre_hooks|_backward_hooks"
    r"|__class__|__call__)\s*=[^=]"
    r"|(?<![\w.])(?!self\.)[A-Za-z_]\w*(\.\w+)*\.__dict__\[[^\]]+\]\s*=[^=]"
    r"|setattr\((?!self\b|cls\b)\w+, *[\"'](zero_grad|step|forward|_parameters|_buffers|__class__)[\"']",
    re.MULTILINE)


def test_no_module_outside_interpose_changes_torch_or_reads_its_private_functions():
    found = []
    for path in _modules_outside_interpose():
        for match in [*_TORCH_CHANGES.finditer(path.read_text()), *_INSTANCE_CHANGES.finditer(path.read_text())]:
            line = path.read_text()[:match.start()].count("\n") + 1
            found.append(f"{path.relative_to(_SRC)}:{line}: {match.group(0).strip()}")
    assert not found, ("changes to torch outside unison/_interpose (move them there, with a registry entry):\n"
                       + "\n".join(found))


def test_the_checks_above_find_what_they_look_for():
    assert _TORCH_CHANGES.search("    handles = [nn.modules.module.register_module_parameter_registration_hook(f)]")
    assert _TORCH_CHANGES.search("torch.optim.Optimizer.step = wrapped")
    assert _TORCH_CHANGES.search("x = torch._C._storage_Use_Count(s)")
    assert _TORCH_CHANGES.search("n = torch._C._len_torch_function_stack()")
    assert not _TORCH_CHANGES.search("model.weight = nn.Parameter(t)")
    assert not _TORCH_CHANGES.search("with torch._C.DisableTorchFunctionSubclass():")
    assert _INSTANCE_CHANGES.search("    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]")
    assert _INSTANCE_CHANGES.search("        module._parameters = ReplicaParameters(parameters)")
    assert _INSTANCE_CHANGES.search("        pending = module.__dict__[_PENDING] = _Pending(module, strategy)")
    assert _INSTANCE_CHANGES.search("    setattr(opt, 'step', wrapped)")
    assert not _INSTANCE_CHANGES.search("        self._buffers = ReplicaGradBuffers(self._num_replicas)")
    assert not _INSTANCE_CHANGES.search("            self._recent.__dict__[key] = (ids, slots)")
    assert not _INSTANCE_CHANGES.search("        if optimizer.zero_grad == other:")
    assert list(_INTERPOSE.glob("*.py")), "unison/_interpose has no modules"
