"""What unison changes in PyTorch is listed in one registry, and importing unison changes nothing.

Every global change (hooks, wrapped methods, a replaced ``__deepcopy__``) is an
``Interposition`` in ``unison._once.INTERPOSITIONS``, installed on first use. A fresh
interpreter that imports every unison module must find torch as it was; one that builds
a model in a multi-replica scope and steps it finds the changes installed.
"""

from __future__ import annotations

import json
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
    from unison._once import INTERPOSITIONS
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
    assert len(registry) == 7, registry
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
