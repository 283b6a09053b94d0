"""``unison.optim.Ftrl`` against TensorFlow 2.21's own numbers.

The expected values were printed by ``benchmarks/tf_ftrl_reference.py`` (TensorFlow 2.21.0,
Keras 3.15.1; TensorFlow is a peer, not a dependency of these tests): dense steps of
``tf.keras.optimizers.Ftrl``, and sparse steps of ``ResourceSparseApplyFtrlV2`` on each id's
summed gradient (what TensorFlow's optimizers hand the kernel), both with every
hyper-parameter away from its default. The inputs below are the script's.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import unison
from unison import DynamicEmbedding
from unison.optim import Ftrl

pytestmark = pytest.mark.timeout(60)

HYPER = {"lr": 0.05, "initial_accumulator_value": 0.2, "l1": 0.01, "l2": 0.03, "l2_shrinkage": 0.02, "beta": 0.5}
DENSE_START = [[0.5, -0.3, 0.02], [-1.2, 0.8, 0.0]]
DENSE_GRADS = [[[0.3, -0.7, 0.05], [1.1, 0.2, -0.4]],
               [[-0.2, 0.4, 0.0], [0.9, -0.6, 0.3]],
               [[0.6, 0.1, -0.02], [-0.5, 0.25, 0.7]],
               [[0.05, -0.3, 0.4], [0.2, 0.0, -0.9]]]
SPARSE_START = [[0.4, -0.6], [0.1, 0.9], [-0.25, 0.3], [0.7, -0.05], [0.0, 0.2]]
SPARSE_STEPS = [([0, 2, 2], [[0.5, -0.2], [0.3, 0.4], [-0.1, 0.6]]),
                ([3, 0], [[-0.8, 0.1], [0.2, 0.2]]),
                ([2, 4, 2, 2], [[0.1, -0.3], [0.9, -0.7], [0.05, 0.05], [-0.4, 0.2]]),
                ([0, 3, 3], [[-0.6, 0.35], [0.25, -0.15], [0.5, 0.45]])]

# tf.keras.optimizers.Ftrl: the variable after each of the four steps
TF_DENSE = {
    -0.5: [[[0.02798944, -0.059186373, -0.0020821323], [-0.5562859, 0.022205204, 0.017679056]],
           [[0.037218604, -0.07313885, -0.0020777623], [-0.5783071, 0.045652032, 0.004870148]],
           [[0.01466834, -0.07653219, -0.0010245751], [-0.56569916, 0.03609101, -0.018225888]],
           [[0.012773941, -0.06627756, -0.019115526], [-0.569948, 0.0360362, 0.005892103]]],
    -0.7: [[[0.034266304, -0.07693567, -0.0023897274], [-0.67013526, 0.02662646, 0.019654961]],
           [[0.044577066, -0.0911575, -0.0023839686], [-0.6895342, 0.051532928, 0.005662383]],
           [[0.020963809, -0.094591826, -0.0011740087], [-0.6784792, 0.04147141, -0.01762329]],
           [[0.01897202, -0.08424309, -0.021274764], [-0.6820693, 0.041405197, 0.004588243]]],
}
# ResourceSparseApplyFtrlV2: the table after step 2 and step 4, and its accumulator and linear terms at the end
TF_SPARSE = {
    -0.5: {"step 2": [[0.04539049, -0.023671491], [0.1, 0.9], [-0.019811798, 0.089693084],
                      [0.258265, -0.0051517934], [0.0, 0.2]],
           "step 4": [[0.06638009, -0.039015446], [0.1, 0.9], [-0.007903323, 0.09114383],
                      [0.23573363, -0.019417876], [-0.029509526, 0.08307181]],
           "accumulator": [[0.85, 0.4025], [0.2, 0.2], [0.3025, 1.2025001], [1.4025, 0.3], [1.01, 0.69]],
           "linear": [[-1.901772, 0.8975459], [0.0, 0.0], [0.176444, -2.9258475], [-7.964935, 0.418056],
                      [0.9, -2.225795]]},
    -0.7: {"step 2": [[0.058573544, -0.027870145], [0.1, 0.9], [-0.022990713, 0.11743977],
                      [0.31033826, -0.0059197377], [0.0, 0.2]],
           "step 4": [[0.07998774, -0.044775877], [0.1, 0.9], [-0.009587167, 0.11882027],
                      [0.28880313, -0.021975413], [-0.029470403, 0.09693827]],
           "accumulator": [[0.85, 0.4025], [0.2, 0.2], [0.3025, 1.2025001], [1.4025, 0.3], [1.01, 0.69]],
           "linear": [[-2.2424088, 0.93404377], [0.0, 0.0], [0.18947558, -3.9091668], [-10.234565, 0.42028606],
                      [0.9, -2.480469]]},
}
# the table's rows 0..4 as DynamicEmbedding ids (any int64)
TABLE_IDS = torch.tensor([2**62 + 5, -3, 0, 2**40, -(2**63)])
POWERS = sorted(TF_DENSE)


def _close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual.detach(), torch.tensor(expected), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("lr_power", POWERS)
def test_dense_parameters_step_as_tf_keras_ftrl(lr_power):
    weight = nn.Parameter(torch.tensor(DENSE_START))
    opt = Ftrl([weight], lr_power=lr_power, **HYPER)
    for grad, expected in zip(DENSE_GRADS, TF_DENSE[lr_power]):
        weight.grad = torch.tensor(grad)
        opt.step()
        _close(weight, expected)
    assert sorted(opt.state[weight]) == ["accumulator", "linear"]


def _sparse_loss(rows: torch.Tensor, grads: list) -> torch.Tensor:
    """A loss whose gradient for occurrence ``k`` of the looked-up rows is ``grads[k]``."""
    return (rows * torch.tensor(grads)).sum()


@pytest.mark.parametrize("lr_power", POWERS)
def test_sparse_gradients_step_the_named_rows_as_tf_sparse_ftrl(lr_power):
    table = nn.Embedding(5, 2, sparse=True)
    with torch.no_grad():
        table.weight.copy_(torch.tensor(SPARSE_START))
    opt = Ftrl(table.parameters(), lr_power=lr_power, **HYPER)
    for step, (ids, grads) in enumerate(SPARSE_STEPS, 1):
        opt.zero_grad()
        _sparse_loss(table(torch.tensor(ids)), grads).backward()
        opt.step()
        if f"step {step}" in TF_SPARSE[lr_power]:
            _close(table.weight, TF_SPARSE[lr_power][f"step {step}"])
    _close(opt.state[table.weight]["accumulator"], TF_SPARSE[lr_power]["accumulator"])
    _close(opt.state[table.weight]["linear"], TF_SPARSE[lr_power]["linear"])


def _table_holding(rows: list, **kwargs) -> DynamicEmbedding:
    """A DynamicEmbedding whose ids ``TABLE_IDS`` hold ``rows`` (loaded as a checkpoint would be)."""
    emb = DynamicEmbedding(2, **kwargs)
    state = emb.state_dict()
    order = TABLE_IDS.argsort()
    state.update(ids=TABLE_IDS[order], rows=torch.tensor(rows)[order], counts=torch.zeros(5, dtype=torch.int64),
                 last_seen=torch.zeros(5, dtype=torch.int64))
    emb.load_state_dict(state)
    return emb


def _by_table_row(emb: DynamicEmbedding, key: str) -> torch.Tensor:
    """A state_dict entry of ``emb`` in the order of the table rows (``TABLE_IDS``)."""
    state = emb.state_dict()
    return state[key][torch.searchsorted(state["ids"], TABLE_IDS)]


@pytest.mark.parametrize("lr_power", POWERS)
def test_dynamic_embedding_rows_step_as_tf_sparse_ftrl_with_state_beside_each_row(lr_power):
    emb = _table_holding(SPARSE_START)
    head = nn.Parameter(torch.tensor(DENSE_START))  # a dense parameter in the same optimizer
    opt = unison.optim.Ftrl([*emb.parameters(), head], lr_power=lr_power, **HYPER)
    for step, ((ids, grads), dense_grad) in enumerate(zip(SPARSE_STEPS, DENSE_GRADS), 1):
        opt.zero_grad()
        (_sparse_loss(emb(TABLE_IDS[ids]), grads) + (head * torch.tensor(dense_grad)).sum()).backward()
        opt.step()
        if f"step {step}" in TF_SPARSE[lr_power]:
            _close(_by_table_row(emb, "rows"), TF_SPARSE[lr_power][f"step {step}"])
    _close(_by_table_row(emb, "state.accumulator"), TF_SPARSE[lr_power]["accumulator"])
    _close(_by_table_row(emb, "state.linear"), TF_SPARSE[lr_power]["linear"])
    _close(head, TF_DENSE[lr_power][-1])
    assert emb.num_rows == 5


@pytest.mark.parametrize("field, value, fix", [
    ("lr", 0.0, "> 0"), ("lr", -0.1, "> 0"), ("lr_power", 0.5, "<= 0"),
    ("initial_accumulator_value", -0.1, ">= 0"), ("l1", -1e-3, ">= 0"), ("l2", -1.0, ">= 0"),
    ("l2_shrinkage", -0.5, ">= 0"), ("beta", -2.0, ">= 0"), ("lr", float("nan"), "finite"), ("l1", "0.1", "finite"),
])
def test_bad_hyper_parameters_are_refused_naming_the_field_and_value(field, value, fix):
    with pytest.raises(ValueError, match=rf"`{field}`.*must be.*{re.escape(fix)}.*{re.escape(repr(value))}.*fix:"):
        Ftrl([nn.Parameter(torch.zeros(2))], **{field: value})


def test_a_setting_made_bad_after_construction_is_refused_at_step_and_nothing_moves():
    emb = _table_holding(SPARSE_START)
    head = nn.Parameter(torch.tensor(DENSE_START))
    opt = Ftrl([{"params": [head]}, {"params": emb.parameters()}], **HYPER)
    before = emb.state_dict()
    opt.param_groups[1]["lr"] = 0.0  # e.g. a scheduler that reached 0
    (emb(TABLE_IDS).sum() + head.sum()).backward()
    with pytest.raises(ValueError, match="`lr`.*0.0"):
        opt.step()
    assert torch.equal(head, torch.tensor(DENSE_START)) and not opt.state
    after = emb.state_dict()
    assert torch.equal(after["rows"], before["rows"]) and "state.linear" not in after


def test_defaults_and_names_are_tensorflows():
    opt = Ftrl([nn.Parameter(torch.zeros(1))])
    assert {k: v for k, v in opt.defaults.items()} == {
        "lr": 0.001, "lr_power": -0.5, "initial_accumulator_value": 0.1, "l1": 0.0, "l2": 0.0,
        "l2_shrinkage": 0.0, "beta": 0.0}
    assert unison.optim.Ftrl is Ftrl and "Ftrl" in unison.optim.__all__


def test_a_copy_unpickled_on_a_worker_steps_as_the_original():
    """torch's ``__setstate__`` adds keys (``differentiable``) to the defaults: Ftrl reads only its own."""
    import pickle

    weight = nn.Parameter(torch.tensor(DENSE_START))
    opt = pickle.loads(pickle.dumps(Ftrl([weight], lr_power=-0.5, **HYPER)))
    weight = opt.param_groups[0]["params"][0]
    weight.grad = torch.tensor(DENSE_GRADS[0])
    opt.step()
    _close(weight, TF_DENSE[-0.5][0])
