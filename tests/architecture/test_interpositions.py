"""What unison changes in PyTorch lives in ``unison.interpose``, listed in one registry; importing changes nothing.

Every global change (hooks, wrapped methods, a replaced ``__deepcopy__``, a mode pushed
for a block) is an ``Interposition`` or ``ScopedInterposition`` in
``unison.interpose.registry.INTERPOSITIONS``, defined in ``unison.interpose`` and installed
on first use. A fresh interpreter that imports every unison module must find torch as it
was; one that builds a model in a multi-replica scope and steps it finds the changes
installed. No module outside ``unison.interpose`` changes torch's classes or global hooks,
or reads the private torch functions ``interpose/torch_private.py`` names.
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
    from unison.interpose.registry import INTERPOSITIONS
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
    assert len(registry) == 9, registry
    for what, target, why, installed in registry:
        assert what and target and why and not installed, (what, target, why, installed)


def test_using_a_strategy_installs_its_changes():
    report = _probe("use")
    assert report["after_use"]["parameter_hooks"] == report["after_use"]["buffer_hooks"] == 1
    assert report["after_use"]["step_pre_hooks"] == report["after_use"]["step_post_hooks"] == 1
    assert report["after_use"]["patched"] == ["GradScaler.step", "Parameter.__deepcopy__"]
    assert report["installed"] == sorted([
        "global module parameter/buffer registration hooks", "global optimizer step pre/post hooks",
        "nn.Parameter.__deepcopy__", "GradScaler.step/update and a per-replica state property",
        "once-per-step wrappers of step / update_parameters / add_param_group, and __init_subclass__",
    ])


_SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "unison"
_INTERPOSE = _SRC / "interpose"


def _modules_outside_interpose() -> list[pathlib.Path]:
    return [path for path in sorted(_SRC.rglob("*.py")) if _INTERPOSE not in path.parents]


def test_every_interposition_is_defined_in_the_interpose_package():
    defined_outside = []
    for path in _modules_outside_interpose():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call)
                    and getattr(node.func, "id", None) in ("Interposition", "ScopedInterposition")):
                defined_outside.append(f"{path.relative_to(_SRC)}:{node.lineno}")
    assert not defined_outside, f"interpositions defined outside unison/interpose: {defined_outside}"


# What changes torch for everyone: global hooks, class attributes assigned, the private
# functions named once in interpose/torch_private.py.
_TORCH_CHANGES = re.compile(
    r"register_module_(module|parameter|buffer)_registration_hook|register_optimizer_step_(pre|post)_hook"
    r"|setattr\((torch|nn)\.|^\s*(torch|nn)\.[\w.]+\s*=[^=]"
    r"|_C\._\w+|_utils\._\w+\(|import _unflatten|_execution_engine|TensorBase\._use_count"
    r"|TorchFunctionMode|_pop_mode_temporarily", re.MULTILINE)


def test_no_module_outside_interpose_changes_torch_or_reads_its_private_functions():
    found = []
    for path in _modules_outside_interpose():
        for match in _TORCH_CHANGES.finditer(path.read_text()):
            line = path.read_text()[:match.start()].count("\n") + 1
            found.append(f"{path.relative_to(_SRC)}:{line}: {match.group(0).strip()}")
    assert not found, ("changes to torch outside unison/interpose (move them there, with a registry entry):\n"
                       + "\n".join(found))


def test_the_checks_above_find_what_they_look_for():
    assert _TORCH_CHANGES.search("    handles = [nn.modules.module.register_module_parameter_registration_hook(f)]")
    assert _TORCH_CHANGES.search("torch.optim.Optimizer.step = wrapped")
    assert _TORCH_CHANGES.search("x = torch._C._storage_Use_Count(s)")
    assert _TORCH_CHANGES.search("n = torch._C._len_torch_function_stack()")
    assert not _TORCH_CHANGES.search("model.weight = nn.Parameter(t)")
    assert not _TORCH_CHANGES.search("with torch._C.DisableTorchFunctionSubclass():")
    assert list(_INTERPOSE.glob("*.py")), "unison/interpose has no modules"
