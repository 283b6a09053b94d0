"""LocalTable: rows from the id alone, sparse row optimizers against torch, eviction
against a pure-Python model, and checkpoints re-split over any shard count bit-equal."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unison._embeddings.optim.row_optimizers import RowAdagrad, RowSGD, RowWiseAdagrad
from unison._embeddings.tables.eviction import EvictBelowCount, EvictionPolicy, EvictUnseen
from unison._embeddings.tables.id_hashing import splitmix64
from unison._embeddings.tables.id_index import IdIndex
from unison._embeddings.tables.initializers import (
    Initializer,
    hash_draws,
    initializer_from_config,
    normal,
    uniform,
    zeros,
)
from unison._embeddings.tables.local_table import LocalTable, shard_of

pytestmark = pytest.mark.timeout(120)

I64_MIN, I64_MAX = -2**63, 2**63 - 1
M64 = 2**64 - 1
int64s = st.integers(I64_MIN, I64_MAX)
EXTREMES = [I64_MIN, I64_MAX, 0, -1, 1, I64_MIN + 1, I64_MAX - 1]


def _mix(x: int) -> int:
    """Vigna's splitmix64.c finaliser on unsigned Python ints: the reference."""
    z = x & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _signed(value: int) -> int:
    value &= M64
    return value - (1 << 64) if value >> 63 else value


def _ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _unsigned(t: torch.Tensor) -> list[int]:
    return [v & M64 for v in t.tolist()]


def _random_ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([_ids(EXTREMES), torch.randint(I64_MIN, I64_MAX, (n,), generator=g)]).unique()


# ---- hashing ------------------------------------------------------------------------------

def test_splitmix64_gives_the_published_sequence():
    seed = 1234567
    states = _ids([_signed(seed + k * 0x9E3779B97F4A7C15) for k in range(1, 6)])  # splitmix64.c's next()
    assert _unsigned(splitmix64(states)) == [6457827717110365317, 3203168211198807973, 9817491932198370423,
                                             4593380528125082431, 16408922859458223821]


@given(st.lists(int64s, min_size=1, max_size=64))
def test_splitmix64_wraps_like_unsigned_64_bit_arithmetic(values):
    assert _unsigned(splitmix64(_ids(values + EXTREMES))) == [_mix(v) for v in values + EXTREMES]


@given(st.lists(int64s, min_size=1, max_size=16), st.integers(0, 2**32), st.integers(1, 5))
def test_hash_draws_are_the_documented_stream_bit_for_bit(values, seed, count):
    # initializers.py: key = mix(id ^ mix(seed)), draw k = (mix(key + k * GAMMA) >> 11) * 2**-53
    ids = _ids(values + EXTREMES)
    expected = [[(_mix(_mix((v & M64) ^ _mix(seed)) + k * 0x9E3779B97F4A7C15) >> 11) * 2.0 ** -53
                 for k in range(1, count + 1)] for v in values + EXTREMES]
    assert hash_draws(ids, seed, count).tolist() == expected
    assert hash_draws(ids[::2], seed, count).tolist() == expected[::2]  # a strided view reads its own ids


def test_splitmix64_leaves_its_input_alone_and_keeps_its_shape():
    ids = _random_ids(50, 8)
    before = ids.clone()
    grid = ids[:48].reshape(6, 8).t()  # not contiguous
    assert _unsigned(splitmix64(grid).reshape(-1)) == [_mix(v) for v in grid.reshape(-1).tolist()]
    assert splitmix64(grid).shape == grid.shape and splitmix64(ids[3]).shape == ()
    assert torch.equal(ids, before)


def test_shard_of_is_pinned():
    # Checkpoints are split by this function: its values must never change.
    assert shard_of(_ids([0, 1, 2, -1, I64_MIN, I64_MAX, 42, 10**18]), 7).tolist() == [1, 4, 0, 1, 5, 3, 6, 3]


@given(st.lists(int64s, min_size=1, max_size=64), st.integers(1, 1000))
def test_shard_of_is_the_documented_formula(values, num_shards):
    expected = [(_mix(v + 0xD1B54A32D192ED03) >> 1) % num_shards for v in values]
    assert shard_of(_ids(values), num_shards).tolist() == expected


@pytest.mark.parametrize("ids", [torch.arange(30000), torch.arange(30000) * 1024, torch.arange(30000) * -4096 - 1])
def test_shard_of_spreads_regular_ids_evenly(ids):
    for num_shards in (2, 3, 4, 8):
        counts = torch.bincount(shard_of(ids, num_shards), minlength=num_shards)
        assert (counts - 30000 / num_shards).abs().max() < 0.05 * 30000 / num_shards


def test_shard_of_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_shards"):
        shard_of(_ids([1]), 0)
    with pytest.raises(TypeError, match="ids.long"):
        shard_of(torch.tensor([1.0]), 2)


@settings(max_examples=40)
@given(st.lists(st.tuples(st.sampled_from(["insert", "insert_at_probe_ends", "remove", "find"]),
                          st.lists(st.one_of(st.sampled_from(EXTREMES + [5, 6, 7]), int64s), max_size=40)),
                max_size=25))
def test_id_index_behaves_as_a_dict(ops):
    index, model, next_slot = IdIndex(), {}, 0
    for op, values in ops:
        values = list(dict.fromkeys(values))
        if op in ("insert", "insert_at_probe_ends"):
            new = [v for v in values if v not in model]
            hint = index.find_with_ends(_ids(new))[1] if op == "insert_at_probe_ends" else None
            index.insert(_ids(new), torch.arange(next_slot, next_slot + len(new)), hint)
            model.update({v: next_slot + i for i, v in enumerate(new)})
            next_slot += len(new)
        elif op == "remove":
            gone = [v for v in values if v in model]
            index.remove(_ids(gone))
            for v in gone:
                del model[v]
        assert index.find(_ids(values)).tolist() == [model.get(v, -1) for v in values]
        assert len(index) == len(model)
    ids, slots = index.items()
    assert dict(zip(ids.tolist(), slots.tolist())) == model


@settings(max_examples=30)
@given(st.lists(st.one_of(st.sampled_from(EXTREMES), int64s), min_size=1, max_size=50))
def test_id_index_probes_start_at_the_documented_hash(values):
    # the index's numpy probe start is id_hashing.splitmix64 masked to the table, bit for bit
    from unison._embeddings.tables.id_index import _home

    ids = _ids(values)
    for mask in (15, 2**20 - 1, 2**62 - 1):
        assert torch.from_numpy(_home(ids.numpy(), mask)).tolist() == (splitmix64(ids) & mask).tolist()


def test_id_index_refuses_ids_that_are_not_int64():
    with pytest.raises(TypeError, match="ids.long"):
        IdIndex().find(torch.tensor([1, 2], dtype=torch.int32))


def test_id_index_keeps_probe_chains_through_removals_and_reuse():
    ids = _random_ids(6000, seed=12)
    index, model = IdIndex(), {}
    g = torch.Generator().manual_seed(13)
    for round_ in range(4):
        new = ids[torch.randperm(ids.numel(), generator=g)[:3000]]
        found, ends = index.find_with_ends(new)
        new, ends = new[found < 0], ends[found < 0]
        slots = torch.arange(new.numel()) + 10_000 * round_
        index.insert(new, slots, ends if round_ % 2 else None)  # from the probes' ends, or from the hashes
        model.update(zip(new.tolist(), slots.tolist()))
        gone = torch.tensor(list(model), dtype=torch.int64)[torch.randperm(len(model), generator=g)[:1500]]
        index.remove(gone)
        for v in gone.tolist():
            del model[v]
        assert index.find(ids).tolist() == [model.get(v, -1) for v in ids.tolist()]
    with pytest.raises(KeyError, match="not in the index"):
        index.remove(gone[:1])


def _walk(entries: list[list[int]], home: int, key: int) -> tuple[int, int, int]:
    """One id's linear probe, entry by entry: ``(position, slot, end)`` as ``IdIndex._locate`` documents
    them (slot -1 = empty, -2 = tombstone; ``end``: the first tombstone passed, else the empty entry)."""
    mask, pos, end = len(entries) - 1, home, -1
    while True:
        entry_key, slot = entries[pos]
        if slot >= 0 and entry_key == key:
            return pos, slot, -1
        if slot == -1:
            return -1, -1, end if end >= 0 else pos
        if slot == -2 and end < 0:
            end = pos
        pos = (pos + 1) & mask


@pytest.mark.parametrize("tombstones", [False, True])
def test_id_index_probe_rounds_equal_a_walk_of_each_chain(tombstones):
    # batches large enough for one-entry rounds and for the windowed rounds of the last ids
    from unison._embeddings.tables.id_index import _home

    g = torch.Generator().manual_seed(21)
    ids = _random_ids(20_000, seed=22)
    index = IdIndex()
    index.insert(ids, torch.arange(ids.numel()))
    if tombstones:
        index.remove(ids[torch.randperm(ids.numel(), generator=g)[:8000]])
    entries = index._table.tolist()
    for size in (40, 700, 5000):
        wanted = torch.cat([ids[torch.randperm(ids.numel(), generator=g)[:size]], _random_ids(size, seed=size)])
        pos, slots, ends = index._locate(wanted)
        homes = _home(wanted.numpy(), len(entries) - 1).tolist()
        expected = [_walk(entries, home, key) for home, key in zip(homes, wanted.tolist())]
        assert list(zip(pos.tolist(), slots.tolist(), ends.tolist())) == expected


# ---- initial rows ------------------------------------------------------------------------

def test_rows_depend_on_id_and_seed_only():
    ids = _random_ids(3000, seed=1)
    one = LocalTable(5, seed=7, initializer=uniform(-1, 1))
    expected = one.lookup(ids)
    shuffled = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(2))]
    other = LocalTable(5, seed=7, initializer=uniform(-1, 1))
    for batch in shuffled.split(333):
        other.lookup(batch)
    assert torch.equal(other.lookup(ids), expected)
    shards = [LocalTable(5, seed=7, initializer=uniform(-1, 1)) for _ in range(3)]
    owner = shard_of(ids, 3)
    rows = torch.cat([shards[j].lookup(ids[owner == j]) for j in range(3)])
    assert torch.equal(rows, torch.cat([expected[owner == j] for j in range(3)]))
    assert not torch.equal(LocalTable(5, seed=8, initializer=uniform(-1, 1)).lookup(ids), expected)


@pytest.mark.parametrize("make", [lambda: uniform(-2.0, 3.0), lambda: normal(0.5, 2.0)])
def test_a_wider_row_extends_a_narrower_one(make):
    ids = _random_ids(100, seed=3)
    narrow, wide = make()(ids, 3, 11, torch.float64), make()(ids, 8, 11, torch.float64)
    assert torch.equal(wide[:, :3], narrow)


def test_uniform_is_the_documented_counter_hash():
    seed, a, b = 5, -0.25, 0.75
    ids = EXTREMES + [123456789, -987654321]
    rows = uniform(a, b)(_ids(ids), 4, seed, torch.float64)
    for i, v in enumerate(ids):
        key = _mix((v & M64) ^ _mix(seed))
        for c in range(4):
            draw = (_mix(key + (c + 1) * 0x9E3779B97F4A7C15) >> 11) * 2.0 ** -53
            assert rows[i, c].item() == a + (b - a) * draw


def test_distributions_have_their_moments():
    ids = torch.arange(-100_000, 100_000)
    u = uniform(-1.0, 3.0)(ids, 2, 0, torch.float64).reshape(-1)
    assert u.min() >= -1.0 and u.max() < 3.0
    assert abs(u.mean().item() - 1.0) < 0.01 and abs(u.var().item() - 16 / 12) < 0.01
    n = normal(2.0, 0.5)(ids, 2, 0, torch.float64).reshape(-1)
    assert abs(n.mean().item() - 2.0) < 0.005 and abs(n.std().item() - 0.5) < 0.005
    empirical = torch.arange(1, n.numel() + 1, dtype=torch.float64) / n.numel()
    ks = (torch.special.ndtr((n.sort().values - 2.0) / 0.5) - empirical).abs().max().item()
    assert ks < 0.005  # Kolmogorov-Smirnov distance to the normal CDF
    assert torch.equal(zeros()(ids[:10], 3, 0, torch.float32), torch.zeros(10, 3))


def test_initializers_round_trip_through_config_and_reject_bad_arguments():
    for init in (uniform(-1, 2), normal(1, 3), zeros()):
        assert repr(initializer_from_config(init.config())) == repr(init)
    with pytest.raises(ValueError, match="a < b"):
        uniform(1, 1)
    with pytest.raises(ValueError, match="std"):
        normal(0, -1)
    with pytest.raises(ValueError, match="not a built-in"):
        initializer_from_config({"kind": "orthogonal"})


def test_lookup_without_create_gives_initial_rows_and_stores_nothing():
    table = LocalTable(4, seed=3)
    stored = table.lookup(_ids([10, 20]))
    table.apply_gradients(_ids([10]), torch.ones(1, 4), RowSGD(lr=1.0))
    peek = table.lookup(_ids([[10, 30], [20, 30]]), create=False)
    assert table.num_rows == 2 and table.export()["counts"].tolist() == [1, 1]
    assert torch.equal(peek[0, 0], stored[0] - 1) and torch.equal(peek[1, 0], stored[1])
    assert torch.equal(peek[0, 1], table.lookup(_ids([30]))[0])


# ---- lookup ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(), (0,), (7,), (2, 3, 4)])
def test_lookup_keeps_the_shape_of_ids(shape):
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor(EXTREMES)[torch.randint(0, len(EXTREMES), shape, generator=g)]
    table = LocalTable(3)
    rows = table.lookup(ids)
    assert rows.shape == (*shape, 3)
    assert torch.equal(rows, table.lookup(ids.reshape(-1)).reshape(*shape, 3))
    assert table.num_rows == ids.unique().numel()


def test_extreme_and_repeated_ids_get_their_own_stable_rows():
    table = LocalTable(6, dtype=torch.float64)
    ids = _ids(EXTREMES + EXTREMES[::-1])
    rows = table.lookup(ids)
    assert torch.equal(rows[: len(EXTREMES)], rows[len(EXTREMES):].flip(0))
    assert rows[: len(EXTREMES)].unique(dim=0).shape[0] == len(EXTREMES)
    assert torch.equal(table.lookup(ids), rows)
    assert table.export()["counts"].tolist() == [4] * len(EXTREMES)


def test_many_rows_grow_the_table_and_stay_consistent():
    ids = _random_ids(20_000, seed=4)
    table = LocalTable(4, initializer=uniform(-1, 1))
    for batch in ids[torch.randperm(ids.numel())].split(1500):
        table.lookup(torch.cat([batch, batch[:100]]))
    assert table.num_rows == ids.numel()
    assert torch.equal(table.export()["ids"], ids)
    assert torch.equal(table.lookup(ids, create=False), uniform(-1, 1)(ids, 4, 0, torch.float32))
    assert table.bytes >= ids.numel() * (4 * 4 + 8 + 8 + 8)


def test_lookup_rejects_bad_ids_and_accepts_narrow_integers():
    table = LocalTable(2)
    assert torch.equal(table.lookup(torch.tensor([1, 2], dtype=torch.int32)), table.lookup(_ids([1, 2])))
    with pytest.raises(TypeError, match="ids.long"):
        table.lookup(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="torch.Tensor"):
        table.lookup([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"embedding_dim": 0}, ValueError, "embedding_dim"),
    ({"embedding_dim": 2, "dtype": torch.int64}, TypeError, "dtype"),
    ({"embedding_dim": 2, "initializer": "normal"}, TypeError, "initializer"),
    ({"embedding_dim": 2, "eviction": 3}, TypeError, "eviction"),
    ({"embedding_dim": 2, "seed": 1.5}, TypeError, "seed"),
])
def test_constructor_names_the_bad_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        LocalTable(**kwargs)


# ---- optimizers --------------------------------------------------------------------------

def _batches(num_ids: int, steps: int = 6, size: int = 40, dim: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, num_ids, (size,), generator=g), torch.randn(size, dim, generator=g))
            for _ in range(steps)]


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")  # torch's own Adagrad, not ours
@pytest.mark.parametrize("row_opt, torch_opt, state", [
    (RowSGD(lr=0.3), lambda p: torch.optim.SGD(p, lr=0.3), None),
    (RowAdagrad(lr=0.3), lambda p: torch.optim.Adagrad(p, lr=0.3, eps=1e-10), "sum"),
    (RowAdagrad(lr=0.2, initial_accumulator_value=0.5, eps=1e-3),
     lambda p: torch.optim.Adagrad(p, lr=0.2, initial_accumulator_value=0.5, eps=1e-3), "sum"),
])
def test_row_optimizer_matches_torch_on_a_sparse_embedding(row_opt, torch_opt, state):
    universe = _random_ids(13, seed=6)  # the extremes and 13 more, distinct
    table = LocalTable(5)
    embedding = torch.nn.Embedding(universe.numel(), 5, sparse=True)
    embedding.weight.data.copy_(table.lookup(universe))
    optimizer = torch_opt(embedding.parameters())
    for positions, grads in _batches(universe.numel()):
        optimizer.zero_grad()
        (embedding(positions) * grads).sum().backward()
        optimizer.step()
        table.apply_gradients(universe[positions], grads, row_opt)
    torch.testing.assert_close(table.lookup(universe), embedding.weight.detach(), rtol=1e-6, atol=1e-6)
    if state:
        kept = dict(zip(table.export()["ids"].tolist(), table.export()["state"][state]))
        expected = optimizer.state[embedding.weight][state]
        torch.testing.assert_close(torch.stack([kept[i] for i in universe.tolist()]), expected, rtol=1e-6, atol=1e-6)


def test_rowwise_adagrad_matches_the_fbgemm_formula():
    lr, eps, start = 0.3, 1e-10, 0.1
    universe = _random_ids(17, seed=7)
    table = LocalTable(5)
    weight = table.lookup(universe).double()
    accumulator = torch.full((universe.numel(),), start, dtype=torch.float64)
    for positions, grads in _batches(universe.numel()):
        dense = torch.zeros_like(weight).index_add_(0, positions, grads.double())
        for row in positions.unique().tolist():
            accumulator[row] += (dense[row] ** 2).mean()
            weight[row] -= lr / (accumulator[row].sqrt() + eps) * dense[row]
        table.apply_gradients(universe[positions], grads, RowWiseAdagrad(lr, eps, initial_accumulator_value=start))
    torch.testing.assert_close(table.lookup(universe), weight.float(), rtol=1e-6, atol=1e-6)
    exported = table.export()
    order = torch.searchsorted(exported["ids"], universe)
    torch.testing.assert_close(exported["state"]["rowwise_sum"][order, 0], accumulator.float(), rtol=1e-6, atol=1e-6)


def test_repeated_ids_in_one_call_are_summed_first():
    grads = torch.randn(3, 4, generator=torch.Generator().manual_seed(8))
    split, joined = LocalTable(4), LocalTable(4)
    split.apply_gradients(_ids([9, I64_MIN, 9]), grads, RowAdagrad(0.1))
    joined.apply_gradients(_ids([9, I64_MIN]), torch.stack([grads[0] + grads[2], grads[1]]), RowAdagrad(0.1))
    assert torch.equal(split.lookup(_ids([9, I64_MIN])), joined.lookup(_ids([9, I64_MIN])))


def test_apply_gradients_checks_its_arguments():
    table = LocalTable(3)
    with pytest.raises(ValueError, match=r"grads` must have shape \(2, 3\)"):
        table.apply_gradients(_ids([1, 2]), torch.ones(2, 4), RowSGD(0.1))
    with pytest.raises(ValueError, match="1-D"):
        table.apply_gradients(_ids([[1, 2]]), torch.ones(2, 3), RowSGD(0.1))
    with pytest.raises(TypeError, match="RowOptimizer"):
        table.apply_gradients(_ids([1]), torch.ones(1, 3), torch.optim.SGD)  # type: ignore[arg-type]
    table.apply_gradients(_ids([1]), torch.ones(1, 3), RowAdagrad(0.1))
    with pytest.raises(ValueError, match="row state 'sum'"):
        table.apply_gradients(_ids([1]), torch.ones(1, 3), RowAdagrad(0.1, initial_accumulator_value=1.0))
    for make, field in [(lambda: RowSGD(-1), "lr"), (lambda: RowAdagrad(0.1, eps=-1), "eps"),
                        (lambda: RowWiseAdagrad(0.1, initial_accumulator_value=math.nan), "initial_accumulator")]:
        with pytest.raises(ValueError, match=field):
            make()


# ---- eviction ----------------------------------------------------------------------------

POOL = EXTREMES + [12345, -987654321]
OPS: st.SearchStrategy[tuple[str, list[int]]] = st.one_of(
    st.tuples(st.just("lookup"), st.lists(st.sampled_from(POOL), max_size=6)),
    st.tuples(st.just("apply"), st.lists(st.sampled_from(POOL), max_size=6)),
    st.tuples(st.just("step"), st.just([])),
    st.tuples(st.just("evict"), st.just([])),
)
POLICIES = st.one_of(st.integers(0, 3).map(EvictUnseen), st.integers(1, 4).map(EvictBelowCount))


RECENT_OPS: st.SearchStrategy[tuple[str, list[int]]] = st.one_of(
    st.tuples(st.sampled_from(["lookup_push", "lookup_take_push", "lookup_lookup_push", "lookup_write_push"]),
              st.lists(st.sampled_from(POOL), min_size=1, max_size=6, unique=True)),
    st.tuples(st.just("reload"), st.just([])),
)


@settings(max_examples=60)
@given(st.lists(RECENT_OPS, max_size=12))
def test_a_push_of_the_looked_up_ids_equals_the_push_of_a_copy(ops):
    # a module's step passes the very ids its forward looked up, and the table applies to their slots without
    # finding them again; that must equal finding them (a copy of the ids), also when rows left between the
    # lookup and the push (their slots free), another lookup came between, the ids tensor was written in place,
    # or the table was reloaded
    same, copy = LocalTable(3), LocalTable(3)
    g = torch.Generator().manual_seed(len(ops))
    others = iter(range(10**6, 10**6 + 1000))
    for op, values in ops:
        if op == "reload":
            for table in (same, copy):
                table.load(table.export())
            continue
        ids = _ids(sorted(values))
        grads = torch.randn(ids.numel(), 3, generator=g)
        newcomers = _ids([next(others) for _ in range(len(values))])
        for table in (same, copy):
            table.lookup(ids, occurrences=torch.ones_like(ids))
            if op == "lookup_take_push":
                table.take(ids[: (ids.numel() + 1) // 2])  # rows leave (a disk tier's spill): their slots are free
            elif op == "lookup_lookup_push":
                table.lookup(newcomers, occurrences=torch.ones_like(newcomers))
        if op == "lookup_write_push":
            ids.add_(1)  # the caller writes the ids it looked up: the same tensor, other ids
        same.push(ids, grads, RowAdagrad(0.1))
        copy.push(ids.clone(), grads, RowAdagrad(0.1))
        a, b = same.export(), copy.export()
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["rows"], b["rows"])
        assert torch.equal(a["state"]["sum"], b["state"]["sum"]) and torch.equal(a["counts"], b["counts"])


@settings(max_examples=80)
@given(POLICIES, st.lists(OPS, max_size=30))
def test_eviction_removes_exactly_the_rows_its_policy_names(policy, ops):
    table = LocalTable(2, eviction=policy)
    model: dict[int, list[int]] = {}  # id -> [lookup count, last seen step]
    step = 0
    for op, values in ops:
        if op == "lookup":
            table.lookup(_ids(values))
            for v in values:
                model.setdefault(v, [0, step])[0] += 1
                model[v][1] = step
        elif op == "apply":
            table.apply_gradients(_ids(values), torch.ones(len(values), 2), RowAdagrad(0.1))
            for v in values:
                model.setdefault(v, [0, step])[1] = step
        elif op == "step":
            step = table.step()
        else:
            if isinstance(policy, EvictUnseen):
                gone = sorted(v for v, (_, seen) in model.items() if step - seen > policy.steps)
            else:
                gone = sorted(v for v, (count, _) in model.items() if count < policy.min_count)
            assert table.evict().tolist() == gone
            for v in gone:
                del model[v]
        exported = table.export()
        assert exported["ids"].tolist() == sorted(model) and table.num_rows == len(model)
        assert exported["counts"].tolist() == [model[v][0] for v in sorted(model)]
        assert exported["last_seen"].tolist() == [model[v][1] for v in sorted(model)]


def test_an_evicted_row_returns_fresh_and_its_slot_is_reused():
    table = LocalTable(3, eviction=EvictBelowCount(2), initializer=uniform(-1, 1))
    fresh = table.lookup(_ids([1, 2, 3]))
    table.lookup(_ids([3]))
    table.apply_gradients(_ids([1, 2, 3]), torch.ones(3, 3), RowAdagrad(0.5))
    size = table.bytes
    assert table.evict().tolist() == [1, 2] and table.num_rows == 1
    again = table.lookup(_ids([2, 1]))
    assert torch.equal(again, fresh[[1, 0]]) and table.bytes == size
    assert table.export()["state"]["sum"][:2].eq(0).all()


def test_without_a_policy_nothing_is_evicted_and_a_bad_policy_is_named():
    table = LocalTable(2)
    table.lookup(_ids([1]))
    assert table.evict().tolist() == [] and table.num_rows == 1

    class Wrong(EvictionPolicy):
        def select(self, counts: torch.Tensor, last_seen: torch.Tensor, step: int) -> torch.Tensor:
            return counts

    with pytest.raises(TypeError, match="bool mask"):
        _evict_with(Wrong())
    with pytest.raises(ValueError, match="steps"):
        EvictUnseen(-1)
    with pytest.raises(ValueError, match="min_count"):
        EvictBelowCount(0)


def _evict_with(policy: EvictionPolicy) -> torch.Tensor:
    table = LocalTable(2, eviction=policy)
    table.lookup(_ids([1]))
    return table.evict()


# ---- export, import, resharding ----------------------------------------------------------

def _train(tables: list[LocalTable], ids: torch.Tensor, steps: int = 4) -> None:
    """The same lookups and updates, each id sent to the table ``shard_of`` names."""
    g = torch.Generator().manual_seed(9)
    for _ in range(steps):
        batch = ids[torch.randint(0, ids.numel(), (3000,), generator=g)]
        grads = torch.randn(batch.numel(), 4, generator=g)
        owner = shard_of(batch, len(tables))
        for j, table in enumerate(tables):
            mine = owner == j
            table.lookup(batch[mine])
            table.apply_gradients(batch[mine], grads[mine], RowAdagrad(0.1, initial_accumulator_value=0.1))
            table.step()


def _assert_exports_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key in ("ids", "rows", "counts", "last_seen"):
        assert torch.equal(got[key], want[key]), key
    assert got["state"].keys() == want["state"].keys()
    assert all(torch.equal(got["state"][name], want["state"][name]) for name in want["state"])
    chain = ("table_id", "sequence", "exact")  # which table and save point, not what it holds
    assert ({k: v for k, v in got["meta"].items() if k not in chain}
            == {k: v for k, v in want["meta"].items() if k not in chain})


def test_two_shards_resplit_into_three_then_merged_into_one_keep_every_bit():
    ids = _random_ids(4000, seed=10)
    single = LocalTable(4, seed=2, initializer=uniform(-1, 1))
    two = [LocalTable(4, seed=2, initializer=uniform(-1, 1)) for _ in range(2)]
    _train([single], ids)
    _train(two, ids)
    exports = [table.export() for table in two]
    three = [LocalTable(4, seed=2, initializer=uniform(-1, 1)) for _ in range(3)]
    for j, table in enumerate(three):
        for export in exports:
            table.import_(export, shard=j, num_shards=3)
        assert (shard_of(table.export()["ids"], 3) == j).all()
    assert sum(table.num_rows for table in three) == single.num_rows
    merged = LocalTable.from_export(three[0].export())
    for table in three[1:]:
        merged.import_(table.export())
    _assert_exports_equal(merged.export(), single.export())


def test_a_restored_table_goes_on_exactly_as_the_original():
    table = LocalTable(3, dtype=torch.float64, seed=4, initializer=normal(0, 0.1), eviction=EvictUnseen(1))
    used = _random_ids(50, seed=11)
    table.lookup(used)
    table.apply_gradients(used, torch.ones(used.numel(), 3), RowWiseAdagrad(0.1))
    table.step()
    restored = LocalTable.from_export(table.export(), eviction=EvictUnseen(1))
    for t in (table, restored):
        t.apply_gradients(_ids([I64_MAX, 77]), torch.full((2, 3), 0.5), RowWiseAdagrad(0.1))
        t.step()
        t.step()
    assert torch.equal(restored.evict(), table.evict())
    _assert_exports_equal(restored.export(), table.export())


def test_import_refuses_what_does_not_fit():
    export = LocalTable(3, seed=1).export()
    with pytest.raises(ValueError, match="embedding_dim=3"):
        LocalTable(4, seed=1).import_(export)
    with pytest.raises(ValueError, match="seed=1"):
        LocalTable(3, seed=2).import_(export)
    with pytest.raises(ValueError, match="both `shard` and `num_shards`"):
        LocalTable(3, seed=1).import_(export, shard=0)
    with pytest.raises(ValueError, match="needs keys"):
        LocalTable(3).import_({"ids": torch.zeros(0, dtype=torch.int64)})

    class Constant(Initializer):
        def __call__(self, ids: torch.Tensor, embedding_dim: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((ids.numel(), embedding_dim), 2.0, dtype=dtype)

        def config(self) -> dict[str, Any]:
            return {"kind": "constant"}

    custom = LocalTable(2, initializer=Constant()).export()
    with pytest.raises(ValueError, match="not a built-in"):
        LocalTable.from_export(custom)
    assert LocalTable.from_export(custom, initializer=Constant()).lookup(_ids([5])).eq(2.0).all()


def test_compacting_moves_live_rows_down_and_keeps_every_row_and_counter():
    table = LocalTable(4, seed=1)
    ids = torch.arange(100) * 13 - 500
    table.lookup(ids)
    table.apply_gradients(ids, torch.ones(100, 4), RowAdagrad(0.1))
    assert not table.compact()  # nothing free: nothing to do
    table.take(ids[:70])  # most rows leave (a disk tier's spill)
    before, generation = table.export(), table.generation
    assert table.compact()
    assert table.generation != generation  # slots read before are stale
    after = table.export()
    for key in ("ids", "rows", "counts", "last_seen"):
        assert torch.equal(after[key], before[key]), key
    assert torch.equal(after["state"]["sum"], before["state"]["sum"])
    assert table._used == 30 and table._rows.shape[0] < 100  # the slots above went back
    assert torch.equal(table.lookup(ids[70:]), before["rows"])  # found at their new slots
    table.lookup(ids[:70])  # and new rows are made after them
    assert table.num_rows == 100 and not table.compact()


def test_an_import_whose_optimizer_state_does_not_fit_is_refused_before_any_row_changes():
    table = LocalTable(4, seed=1)
    ids = torch.arange(5)
    table.lookup(ids)
    table.apply_gradients(ids, torch.ones(5, 4), RowAdagrad(0.1))  # state "sum", 4 columns
    before = table.export()
    other = LocalTable(4, seed=1)
    other.lookup(torch.arange(3, 9))
    export = other.export()
    export["state"] = {"sum": torch.zeros(6, 2)}  # 2 columns: another optimizer configuration
    export["meta"] = {**export["meta"], "state_init": {"sum": 0.0}}
    with pytest.raises(ValueError, match=r"row state 'sum' \(2 columns starting at 0.0\) differs.*fix: use one "
                                         r"optimizer configuration"):
        table.import_(export)
    after = table.export()
    assert torch.equal(after["ids"], before["ids"]) and torch.equal(after["rows"], before["rows"])


def _cache_table() -> LocalTable:
    table = LocalTable(2, seed=1)
    for ids in ([10, 11, 12], [13, 14], [10, 15]):
        table.lookup(torch.tensor(ids))  # last seen: 11, 12 at step 0; 13, 14 at 1; 10, 15 at 2
        table.step()
    table.lookup(torch.tensor([12]))  # 12: seen at step 3, used twice
    return table


@pytest.mark.parametrize(("count", "policy", "protect_from", "taken"), [
    (3, "lru", 3, [11, 13, 14]),  # least recently used first, ties by fewer uses, then by id
    (10, "lru", 3, [10, 11, 13, 14, 15]),  # rows seen at step 3 or later stay
    (4, "lfu", 99, [11, 13, 14, 15]),  # least often used first (10 twice, 12 twice), ties by older use, then by id
    (1, "lfu", 99, [11]),
    (0, "lru", 99, []),
])
def test_take_coldest_moves_out_the_rows_a_cache_keeps_least_and_never_the_steps_own(count, policy, protect_from,
                                                                                     taken):
    table, twin = _cache_table(), _cache_table()
    before = twin.export()
    moved = table.take_coldest(count, policy, protect_from)
    assert moved["ids"].tolist() == taken  # sorted by id, as ``take`` gives them
    expected = twin.take(torch.tensor(taken, dtype=torch.int64), moving=True)
    for key in ("ids", "rows", "counts", "last_seen", "changed_in"):
        assert torch.equal(moved[key], expected[key]), key
    assert sorted(table.export()["ids"].tolist()) == sorted(set(before["ids"].tolist()) - set(taken))
    assert table.num_rows == 6 - len(taken)


@settings(max_examples=60)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=40), st.data(),
       st.sampled_from(["lru", "lfu"]))
def test_least_kept_is_the_first_rows_of_a_plain_sort(rows, data, policy):
    # the oracle: Python's sort by (last seen, count, id) for lru, (count, last seen, id) for lfu
    import numpy as np

    from unison._embeddings.tables.capacity import least_kept

    count = data.draw(st.integers(1, len(rows)))
    ids = np.arange(len(rows))[::-1] * 7  # ids not in position order
    seen, uses = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
    order = sorted(range(len(rows)), key=lambda i: ((seen[i], uses[i]) if policy == "lru" else (uses[i], seen[i]))
                   + (ids[i],))
    assert sorted(least_kept(policy, seen, uses, ids, count).tolist()) == sorted(order[:count])
