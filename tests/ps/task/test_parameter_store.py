"""The ps store applies optimizers next to each tensor, whole or by rows."""

import threading

import pytest
import torch

from unison._ps.task.parameter_store import ParameterStore


def test_dense_sgd_momentum_matches_local_optimizer():
    store = ParameterStore()
    w0 = torch.randn(4, 3)
    store.create("w", w0)
    local = w0.clone().requires_grad_(True)
    opt = torch.optim.SGD([local], lr=0.1, momentum=0.9)
    for _step in range(3):
        g = torch.randn(4, 3)
        local.grad = g.clone()
        opt.step()
        store.apply("w", g, None, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    torch.testing.assert_close(store.read("w"), local.detach())


class _NeedsLr(torch.optim.SGD):
    """An optimizer whose constructor requires lr (no default), as custom ones often do."""

    def __init__(self, params, lr, momentum=0.0):
        super().__init__(params, lr=lr, momentum=momentum)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, _NeedsLr])
def test_a_group_with_a_schedulers_initial_lr_and_a_name_is_applied_as_the_local_step(cls):
    # An LR scheduler adds "initial_lr" to every group, and users add keys such as "name":
    # the ps task built the optimizer with them as constructor arguments, a TypeError.
    store = ParameterStore()
    w0 = torch.randn(4, 3)
    store.create("w", w0)
    local = w0.clone().requires_grad_(True)
    opt = cls([{"params": [local], "name": "w"}], lr=0.1, momentum=0.9) if cls is _NeedsLr else \
        cls([{"params": [local], "name": "w"}], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        g = torch.randn(4, 3)
        local.grad = g.clone()
        hyper = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        assert {"initial_lr", "name"} <= hyper.keys()
        opt.step()
        store.apply("w", g, None, cls, hyper)
        scheduler.step()
    torch.testing.assert_close(store.read("w"), local.detach())


def test_plain_sgd_shortcut_matches_the_optimizer():
    store = ParameterStore()
    w0 = torch.randn(4, 3)
    store.create("w", w0)
    local = w0.clone().requires_grad_(True)
    opt = torch.optim.SGD([local], lr=0.3)
    for _ in range(2):
        g = torch.randn(4, 3)
        local.grad = g.clone()
        opt.step()
        store.apply("w", g.reshape(-1), None, torch.optim.SGD, {"lr": 0.3, "momentum": 0, "weight_decay": 0})
    torch.testing.assert_close(store.read("w"), local.detach())


@pytest.mark.parametrize("cls, hyper", [(torch.optim.SGD, {"lr": 0.5}), (torch.optim.Adam, {"lr": 0.01})])
def test_row_updates_equal_dense_updates_with_zero_rows(cls, hyper):
    store = ParameterStore()
    w0 = torch.randn(6, 2)
    store.create("t", w0)
    local = w0.clone().requires_grad_(True)
    opt = cls([local], **hyper)
    ids, rows = torch.tensor([1, 4]), torch.randn(2, 2)
    dense = torch.zeros(6, 2)
    dense[ids] = rows
    local.grad = dense
    opt.step()
    store.apply("t", rows, ids, cls, hyper)
    torch.testing.assert_close(store.read("t"), local.detach())
    torch.testing.assert_close(store.read_rows("t", ids), local.detach()[ids])


def test_concurrent_pushes_are_each_applied_whole():
    store = ParameterStore()
    store.create("w", torch.zeros(1000))

    def push():
        for _ in range(200):
            store.apply("w", -torch.ones(1000), None, torch.optim.SGD, {"lr": 1.0})

    threads = [threading.Thread(target=push) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(store.read("w"), torch.full((1000,), 800.0))


def test_unknown_key_names_it():
    with pytest.raises(KeyError, match="'nope'"):
        ParameterStore().read("nope")


def test_added_differences_from_concurrent_sessions_all_count():
    store = ParameterStore()
    store.create("n", torch.tensor(0))
    store.create("m", torch.zeros(2, 2))

    def worker():
        for _ in range(200):
            store.add("n", torch.tensor(1))
            store.add("m", torch.full((4,), 0.5))  # any shape of as many elements

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert store.read("n").item() == 800 and store.read("n").dtype == torch.int64
    torch.testing.assert_close(store.read("m"), torch.full((2, 2), 400.0))
