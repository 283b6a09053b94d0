"""Table policies on a LocalTable: admission (count sketch, AdmitAfter, AdmitWithProbability),
a row capacity (LRU/LFU), and a time to live in seconds (a replaced clock), each against a
pure-Python model, through checkpoints and re-splits."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unison._embeddings.optim.row_optimizers import RowAdagrad, RowSGD
from unison._embeddings.tables.admission_policies import occurrence_draws
from unison._embeddings.tables.count_sketch import CountMinSketch
from unison._embeddings.tables.id_hashing import GOLDEN_GAMMA, splitmix64_int
from unison._embeddings.tables.initializers import uniform
from unison._embeddings.tables.local_table import LocalTable, shard_of
from unison.embeddings import AdmitAfter, AdmitWithProbability, EvictBelowCount, EvictUnseen

pytestmark = pytest.mark.timeout(120)

I64_MIN, I64_MAX = -2**63, 2**63 - 1
POOL = [I64_MIN, I64_MAX, 0, -1, 1, 12345, -987654321, 2**40 + 3]
SMALL_SKETCH = {"sketch_width": 4096, "sketch_depth": 4}


def _ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class ManualClock:
    """A monotonic clock that moves only when told (the tests' replacement for time.monotonic)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- the count sketch -----------------------------------------------------------------------

def test_the_sketch_counts_a_few_ids_exactly_never_under_counts_and_merges_by_maximum():
    sketch = CountMinSketch(width=1 << 12, depth=4)
    assert sketch.nbytes == 0 and sketch.max_bytes == 4 * 4096 * 4  # nothing until the first count
    ids = _ids(POOL)
    sketch.add(ids, torch.arange(1, len(POOL) + 1))
    sketch.add(ids[:2], torch.tensor([5, 5]))
    assert sketch.estimate(ids).tolist() == [6, 7, *range(3, len(POOL) + 1)]
    sketch.remove(ids[:1], torch.tensor([6]))
    assert sketch.estimate(ids[:2]).tolist() == [0, 7] and sketch.nbytes == 4 * 4096 * 4
    # many ids in a narrow sketch: estimates are at least the truth
    narrow = CountMinSketch(width=64, depth=3)
    g = torch.Generator().manual_seed(0)
    many = torch.randint(I64_MIN, I64_MAX, (500,), generator=g, dtype=torch.int64)
    truth = torch.randint(1, 5, (500,), generator=g)
    narrow.add(many, truth)
    assert (narrow.estimate(many) >= truth).all() and (narrow.estimate(many) > truth).any()
    # merging: the maximum of two shards' sketches keeps each shard's counts; merging a copy twice changes nothing
    other = CountMinSketch(width=1 << 12, depth=4)
    other.add(_ids([77, 78]), torch.tensor([2, 3]))
    merged = CountMinSketch(width=1 << 12, depth=4)
    for _ in range(2):
        merged.merge(sketch.cells(), "test")
        merged.merge(other.cells(), "test")
    assert merged.estimate(_ids([*POOL[1:], 77, 78])).tolist() == [7, *range(3, len(POOL) + 1), 2, 3]
    with pytest.raises(ValueError, match="sketch_width=64, sketch_depth=3"):
        merged.merge(narrow.cells(), "the export")


# ---- admission ------------------------------------------------------------------------------

def test_admit_after_makes_the_row_in_exactly_the_lookup_that_reaches_the_count():
    plain = LocalTable(3, seed=4, initializer=uniform(-1, 1))
    table = LocalTable(3, seed=4, initializer=uniform(-1, 1), admission=AdmitAfter(3, **SMALL_SKETCH))
    # id 5: once, once (zeros, no row) then twice in one lookup (count 4 >= 3): its row, read twice
    assert table.lookup(_ids([5, 6])).eq(0).all() and table.num_rows == 0
    assert table.lookup(_ids([5])).eq(0).all() and table.num_rows == 0
    assert table.lookup(_ids([5, 6]), create=False).eq(0).all()  # evaluation reads zeros and counts nothing
    rows = table.lookup(_ids([5, 7, 5]))
    assert table.num_rows == 1 and rows[1].eq(0).all()
    assert torch.equal(rows[0], plain.lookup(_ids([5]))[0]) and torch.equal(rows[2], rows[0])  # the same row as without
    export = table.export()
    assert export["ids"].tolist() == [5] and export["counts"].tolist() == [4]
    # updates: an id without a row takes none and gets no row; an admitted one trains
    table.apply_gradients(_ids([5, 6, 7]), torch.ones(3, 3), RowSGD(lr=0.5))
    assert table.num_rows == 1
    torch.testing.assert_close(table.lookup(_ids([5]), create=False), rows[:1] - 0.5)
    # id 6: seen once above (the evaluation lookup did not count), twice more admits it
    assert table.lookup(_ids([6])).eq(0).all()
    assert not table.lookup(_ids([6])).eq(0).all() and table.num_rows == 2


def test_an_evicted_id_counts_again_from_zero():
    table = LocalTable(2, eviction=EvictUnseen(0), admission=AdmitAfter(2, **SMALL_SKETCH))
    table.lookup(_ids([9, 9]))
    assert table.num_rows == 1
    table.step()
    assert table.evict().tolist() == [9] and table.num_rows == 0
    assert table.lookup(_ids([9])).eq(0).all() and table.num_rows == 0  # count 1 of 2 again
    table.lookup(_ids([9]))
    assert table.num_rows == 1


def _first_admitting_occurrence(value: int, seed: int, p: float) -> int:
    """The pure-Python draw: occurrence k of ``value`` admits when its hash, read as [0, 1), is below p."""
    def mix(x: int) -> int:
        return splitmix64_int(x) & (2**64 - 1)

    key = mix(value + splitmix64_int(seed ^ 0x2545F4914F6CDD1D))
    k = 0
    while (mix(key + k * (GOLDEN_GAMMA & (2**64 - 1))) >> 11) / 2**53 >= p:
        k += 1
    return k


@settings(max_examples=30)
@given(st.sampled_from(POOL), st.integers(-5, 5), st.sampled_from([0.05, 0.3, 1.0]),
       st.lists(st.integers(1, 4), min_size=1, max_size=12))
def test_admit_with_probability_admits_at_the_occurrence_its_hash_names_however_lookups_split(value, seed, p, batches):
    table = LocalTable(2, seed=seed, admission=AdmitWithProbability(p, **SMALL_SKETCH))
    first = _first_admitting_occurrence(value, seed, p)
    seen = 0
    for occurrences in batches:
        table.lookup(_ids([value] * occurrences))
        seen += occurrences
        assert table.num_rows == (1 if seen > first else 0), (seen, first)


def test_admit_with_probability_admits_at_its_rate_and_the_same_on_every_table():
    ids = torch.arange(20000, dtype=torch.int64) * 7919 - 10**9
    once = occurrence_draws(ids, torch.zeros_like(ids), torch.ones_like(ids), 3, 0.25)
    assert abs(once.double().mean().item() - 0.25) < 0.015
    twice = occurrence_draws(ids, torch.zeros_like(ids), torch.full_like(ids, 2), 3, 0.25)
    assert abs(twice.double().mean().item() - (1 - 0.75**2)) < 0.015
    assert torch.equal(occurrence_draws(ids, torch.zeros_like(ids), torch.ones_like(ids), 3, 0.25), once)
    assert not torch.equal(occurrence_draws(ids, torch.zeros_like(ids), torch.ones_like(ids), 4, 0.25), once)


def test_the_ps_fast_path_skips_ids_without_a_row():
    table = LocalTable(2, admission=AdmitAfter(2, **SMALL_SKETCH), initializer=uniform(-1, 1))
    table.lookup(_ids([1]))
    rows, slots = table.lookup_distinct(_ids([1, 2]), torch.tensor([1, 1]))
    assert slots[0] >= 0 and slots[1] == -1 and rows[1].eq(0).all()
    table.apply_to_slots(slots, torch.ones(2, 2), RowSGD(lr=1.0))
    torch.testing.assert_close(table.lookup(_ids([1]), create=False), rows[:1] - 1)
    assert table.num_rows == 1


# ---- capacity -------------------------------------------------------------------------------

CAPACITY_OPS: st.SearchStrategy[tuple[str, list[int]]] = st.one_of(
    st.tuples(st.just("lookup"), st.lists(st.sampled_from(POOL), max_size=5)),
    st.tuples(st.just("apply"), st.lists(st.sampled_from(POOL), max_size=5)),
    st.tuples(st.just("push"), st.lists(st.sampled_from(POOL), max_size=5)),
)


@settings(max_examples=60)
@given(st.integers(1, 5), st.sampled_from(["lru", "lfu"]), st.lists(CAPACITY_OPS, max_size=30))
def test_capacity_keeps_exactly_the_rows_its_order_names(capacity, policy, ops):
    table = LocalTable(2, capacity=capacity, capacity_policy=policy)
    model: dict[int, list[int]] = {}  # id -> [count, last seen step]
    step = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step may touch more rows than the capacity
        for op, values in ops:
            if op == "lookup":
                table.lookup(_ids(values))
                for v in values:
                    model.setdefault(v, [0, step])[0] += 1
                    model[v][1] = step
            else:
                grads = torch.ones(len(values), 2)
                if op == "apply":
                    table.apply_gradients(_ids(values), grads, RowSGD(lr=0.1))
                else:
                    table.push(_ids(values), grads, RowSGD(lr=0.1))
                for v in values:
                    model.setdefault(v, [0, step])[1] = step
                if op == "push":
                    step += 1
                    candidates = [v for v, (_, seen) in model.items() if seen < step - 1]
                    key = ((lambda v: (model[v][1], model[v][0], v)) if policy == "lru"
                           else (lambda v: (model[v][0], model[v][1], v)))
                    for v in sorted(candidates, key=key)[:max(0, len(model) - capacity)]:
                        del model[v]
            exported = table.export()
            assert exported["ids"].tolist() == sorted(model)
            assert exported["counts"].tolist() == [model[v][0] for v in sorted(model)]
            assert exported["last_seen"].tolist() == [model[v][1] for v in sorted(model)]


def test_capacity_keeps_the_n_most_recently_used_rows_and_warns_once_when_a_step_needs_more():
    table = LocalTable(2, capacity=3)
    for ids in ([1, 2, 3], [4], [2], [5]):
        table.lookup(_ids(ids))
        table.push(_ids(ids), torch.ones(len(ids), 2), RowSGD(lr=0.1))
    assert table.export()["ids"].tolist() == [2, 4, 5]  # 1 and 3 least recently used
    many = _ids([10, 11, 12, 13])
    with pytest.warns(RuntimeWarning, match="over the capacity of 3"):
        table.push(many, torch.ones(4, 2), RowSGD(lr=0.1))
    assert table.export()["ids"].tolist() == [10, 11, 12, 13]  # touched this step: kept, over capacity
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per table
        table.push(many, torch.ones(4, 2), RowSGD(lr=0.1))
    table.push(_ids([10]), torch.ones(1, 2), RowSGD(lr=0.1))
    assert table.export()["ids"].tolist() == [10, 12, 13]  # 11..13 tie on last step and count: the smallest goes


def test_capacity_combines_with_eviction_and_admission():
    table = LocalTable(2, capacity=2, eviction=EvictBelowCount(2), admission=AdmitAfter(2, **SMALL_SKETCH))
    table.lookup(_ids([1, 1, 2, 2, 3, 3, 4]))  # 1, 2, 3 admitted (count 2), 4 waits
    table.lookup(_ids([1, 2]))
    with pytest.warns(RuntimeWarning, match="capacity"):
        table.push(_ids([]), torch.zeros(0, 2), RowSGD(lr=0.1))
    assert table.num_rows == 3  # all touched this step
    table.lookup(_ids([3]))
    table.push(_ids([3]), torch.ones(1, 2), RowSGD(lr=0.1))
    assert table.export()["ids"].tolist() == [2, 3]  # 1 and 2 tie on step and count: the smaller id goes


def test_memory_stays_bounded_by_the_capacity_while_new_ids_keep_coming():
    table = LocalTable(16, capacity=2000)
    sizes = []
    for step in range(40):
        ids = torch.arange(step * 1000, (step + 1) * 1000, dtype=torch.int64) * 7919
        table.lookup(ids)
        table.push(ids, torch.ones(1000, 16), RowAdagrad(0.1))
        sizes.append(table.bytes)
        assert table.num_rows == min(2000, (step + 1) * 1000)
    assert max(sizes[3:]) == sizes[3]  # after the third step new rows only reuse freed slots
    per_row = 16 * 4 * 2 + 8 * 3 + 1  # row, Adagrad state, id, count, last seen, live flag
    assert sizes[-1] < 3000 * per_row + 4 * 4096 * 16 + 3000 * 8  # 3000 slots (capacity + one step) + index + free list


def test_bad_capacity_and_admission_arguments_are_refused_naming_the_field():
    for kwargs, match in [({"capacity": 0}, "`capacity` must be an int >= 1"), ({"capacity": True}, "`capacity`"),
                          ({"capacity": 2.5}, "`capacity`"), ({"capacity_policy": "fifo"}, "`capacity_policy`"),
                          ({"capacity": 4, "capacity_policy": "LRU"}, "capacity_policy='lru'")]:
        with pytest.raises(ValueError, match=match):
            LocalTable(2, **kwargs)
    for make, match in [(lambda: AdmitAfter(0), "`count` must be an int >= 1"), (lambda: AdmitAfter(2.0), "`count`"),
                        (lambda: AdmitWithProbability(0.0), r"`p` must be a probability in \(0, 1\]"),
                        (lambda: AdmitWithProbability(1.5), "`p`"), (lambda: AdmitWithProbability(math.nan), "`p`"),
                        (lambda: AdmitAfter(2, sketch_width=0), "`sketch_width`"),
                        (lambda: EvictUnseen(), "give `steps`"), (lambda: EvictUnseen(seconds=-1.0), "`seconds`")]:
        with pytest.raises(ValueError, match=match):
            make()
    with pytest.raises(TypeError, match="`admission` must be an AdmissionPolicy"):
        LocalTable(2, admission=2)


# ---- time to live ---------------------------------------------------------------------------

def test_a_time_to_live_in_seconds_evicts_by_the_clock_and_either_limit_suffices():
    clock = ManualClock()
    table = LocalTable(2, eviction=EvictUnseen(3, seconds=10.0, clock=clock))
    table.lookup(_ids([1, 2]))
    clock.now += 6
    table.push(_ids([2]), torch.ones(1, 2), RowSGD(lr=0.1))
    clock.now += 5  # 1: idle 11 s > 10; 2: idle 5 s
    assert table.lookup(_ids([3])).shape == (1, 2)
    assert table.evict().tolist() == [1]
    for _ in range(4):  # no time passes, but 3 is unseen for 4 steps > 3
        table.step()
    assert table.evict().tolist() == [2, 3]
    seconds_only = LocalTable(2, eviction=EvictUnseen(seconds=0.5, clock=clock))
    seconds_only.lookup(_ids([4]))
    for _ in range(100):
        seconds_only.step()
    assert seconds_only.evict().tolist() == [] and seconds_only.num_rows == 1
    assert repr(EvictUnseen(seconds=2)) == "EvictUnseen(seconds=2.0)" and repr(EvictUnseen(4)) == "EvictUnseen(steps=4)"


def test_idle_seconds_survive_a_checkpoint_on_another_clock():
    clock, later = ManualClock(), ManualClock()
    later.now = 5.0  # another process: its monotonic clock has another origin
    policy = EvictUnseen(seconds=10.0, clock=clock)
    table = LocalTable(2, eviction=policy)
    table.lookup(_ids([1]))
    clock.now += 7
    table.lookup(_ids([2]))
    export = table.export()
    assert export["idle_seconds"].tolist() == [7.0, 0.0]
    restored = LocalTable.from_export(export, eviction=EvictUnseen(seconds=10.0, clock=later))
    later.now += 4
    assert restored.evict().tolist() == [1] and restored.export()["idle_seconds"].tolist() == [4.0]
    plain = LocalTable(2)
    plain.lookup(_ids([6]))
    restored.import_(plain.export())  # rows saved without idle times count as touched now
    assert restored.export()["idle_seconds"].tolist() == [4.0, 0.0]


# ---- checkpoints and re-splits ----------------------------------------------------------------

def _admission_tables(num_shards: int) -> list[LocalTable]:
    return [LocalTable(2, seed=1, initializer=uniform(-1, 1), admission=AdmitAfter(3, **SMALL_SKETCH))
            for _ in range(num_shards)]


def _feed(tables: list[LocalTable], values: list[int]) -> None:
    ids = _ids(values)
    owner = shard_of(ids, len(tables))
    for k, table in enumerate(tables):
        table.lookup(ids[owner == k])


def test_admission_counts_survive_a_resplit_from_two_shards_to_three_and_back_to_one():
    ids = list(range(-20, 20))
    single, two = _admission_tables(1), _admission_tables(2)
    for tables in (single, two):
        _feed(tables, ids)
        _feed(tables, ids[:20])  # ids -20..-1 seen twice, 0..19 once: none admitted yet
        _feed(tables, ids[:5])  # -20..-16 admitted
    exports = [table.export() for table in two]
    three = _admission_tables(3)
    for k, table in enumerate(three):
        for export in exports:
            table.import_(export, shard=k, num_shards=3)
    merged = LocalTable.from_export(three[0].export(), admission=AdmitAfter(3, **SMALL_SKETCH))
    for table in three[1:]:
        merged.import_(table.export())
    for tables in (single, three, [merged]):
        assert sum(t.num_rows for t in tables) == 5
        _feed(tables, ids[5:20])  # -15..-1 reach 3
        assert sum(t.num_rows for t in tables) == 20
        _feed(tables, ids[20:])  # 0..19 reach 2, then 3
        assert sum(t.num_rows for t in tables) == 20
        _feed(tables, ids[20:])
        assert sum(t.num_rows for t in tables) == 40
    assert torch.equal(merged.export()["rows"], single[0].export()["rows"])


def test_a_restored_table_admits_where_the_original_does():
    table = _admission_tables(1)[0]
    _feed([table], [1, 2, 2, 3])
    restored = LocalTable(2, seed=1, initializer=uniform(-1, 1), admission=AdmitAfter(3, **SMALL_SKETCH))
    restored.load(table.export())
    for t in (table, restored):
        _feed([t], [1, 2])
    assert restored.export()["ids"].tolist() == table.export()["ids"].tolist() == [2]
    with pytest.raises(ValueError, match="sketch_width=4096"):
        LocalTable(2, seed=1, admission=AdmitAfter(3, sketch_width=8)).import_(table.export())
    LocalTable(2, seed=1).import_(table.export())  # a table without admission ignores the counts


# ---- through DynamicEmbedding ---------------------------------------------------------------

DIM = 3


def _stream(steps: int = 8, seed: int = 0) -> list[torch.Tensor]:
    """Batches of 2-id bags from a pool where some ids are frequent and some rare."""
    g = torch.Generator().manual_seed(seed)
    pool = _ids(POOL + [100 + k for k in range(12)])
    weights = torch.cat([torch.full((len(POOL),), 4.0), torch.ones(12)])
    return [pool[torch.multinomial(weights, 8, replacement=True, generator=g)].reshape(4, 2) for _ in range(steps)]


def test_an_admitted_row_trains_as_a_plain_embedding_whose_unadmitted_rows_are_held_at_zero():
    from torch import nn

    from unison import DynamicEmbedding

    batches = _stream()
    emb = DynamicEmbedding(DIM, mode="mean", seed=2, admission=AdmitAfter(3, **SMALL_SKETCH))
    vocabulary = torch.unique(torch.cat([b.reshape(-1) for b in batches]))
    plain = nn.Embedding(vocabulary.numel(), DIM)
    with torch.no_grad():
        plain.weight.copy_(DynamicEmbedding(DIM, seed=2).table.lookup(vocabulary, create=False))
    head, plain_head = nn.Linear(DIM, 1), nn.Linear(DIM, 1)
    plain_head.load_state_dict(head.state_dict())
    opt = torch.optim.Adagrad([*emb.parameters(), *head.parameters()], lr=0.3)
    plain_opt = torch.optim.Adagrad([*plain.parameters(), *plain_head.parameters()], lr=0.3)
    counts = torch.zeros(vocabulary.numel(), dtype=torch.int64)
    made_at = {}
    for step, ids in enumerate(batches):
        opt.zero_grad(), plain_opt.zero_grad()
        head(emb(ids)).square().mean().backward()
        opt.step()
        index = torch.searchsorted(vocabulary, ids)
        counts += torch.bincount(index.reshape(-1), minlength=vocabulary.numel())
        admitted = (counts >= 3).to(torch.float32)  # this batch's count included
        rows = plain(index) * admitted[index].unsqueeze(-1)  # a zero row (and no gradient) until admitted
        plain_head(rows.mean(1)).square().mean().backward()
        plain_opt.step()
        for v in vocabulary[counts >= 3].tolist():
            made_at.setdefault(v, step)
        assert emb.num_rows == int((counts >= 3).sum())
        assert set(emb.table.export()["ids"].tolist()) == set(made_at)
    assert 0 < emb.num_rows < vocabulary.numel() and len(set(made_at.values())) > 2  # rows made at several steps
    kept = emb.table.export()["ids"]
    torch.testing.assert_close(emb.table.lookup(kept, create=False),
                               plain.weight.detach()[torch.searchsorted(vocabulary, kept)], rtol=0, atol=1e-6)
    torch.testing.assert_close(head.weight, plain_head.weight, rtol=0, atol=1e-6)


def test_evaluation_never_counts_toward_admission():
    from unison import DynamicEmbedding

    emb = DynamicEmbedding(DIM, admission=AdmitAfter(2, **SMALL_SKETCH))
    ids = _ids([4, 5])
    emb.eval()
    for _ in range(3):
        assert emb(ids).eq(0).all()
    emb.train()
    with torch.no_grad():
        emb(ids)  # training mode without grad: not a training lookup
    assert emb(ids).eq(0).all() and emb.num_rows == 0
    assert emb(ids).ne(0).any() and emb.num_rows == 2


def test_a_checkpoint_carries_the_admission_counts_and_training_goes_on_identically(tmp_path):
    from unison import DynamicEmbedding

    def make():
        return DynamicEmbedding(DIM, mode="sum", admission=AdmitAfter(2, **SMALL_SKETCH), capacity=12,
                                eviction=EvictUnseen(4))

    batches = _stream(10, seed=1)
    emb = make()
    opt = torch.optim.Adagrad(emb.parameters(), lr=0.1)
    for ids in batches[:5]:
        opt.zero_grad(), emb(ids).sum().backward(), opt.step()
    torch.save(emb.state_dict(), tmp_path / "emb.pt")
    restored = make()
    restored.load_state_dict(torch.load(tmp_path / "emb.pt", weights_only=False))
    assert "pending_counts" in emb.state_dict() and restored.num_rows == emb.num_rows
    restored_opt = torch.optim.Adagrad(restored.parameters(), lr=0.1)
    for ids in batches[5:]:
        for module, optimizer in ((emb, opt), (restored, restored_opt)):
            optimizer.zero_grad(), module(ids).sum().backward(), optimizer.step()
    for key in ("ids", "rows", "counts", "last_seen", "pending_counts"):
        assert torch.equal(restored.state_dict()[key], emb.state_dict()[key]), key


def test_the_module_keeps_the_capacitys_most_recently_used_rows_after_each_step():
    from unison import DynamicEmbedding

    emb = DynamicEmbedding(DIM, capacity=8)  # a batch has 8 ids: never over capacity
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    evicted = 0
    last: dict[int, int] = {}
    count: dict[int, int] = {}
    for step, ids in enumerate(_stream(12, seed=3)):
        flat = ids.reshape(-1).tolist()
        opt.zero_grad(), emb(ids).sum().backward(), opt.step()
        for v in flat:
            last[v], count[v] = step, count.get(v, 0) + 1
        others = sorted(set(last) - set(flat), key=lambda v: (-last[v], -count[v], -v))  # most recently used first
        keep = set(flat) | set(others[:max(0, 8 - len(set(flat)))])
        for v in set(last) - keep:
            del last[v], count[v]
            evicted += 1
        assert sorted(emb.table.export()["ids"].tolist()) == sorted(keep), step
    assert evicted > 5


def test_bad_policy_arguments_are_refused_before_a_table_is_made():
    from unison import DynamicEmbedding

    for kwargs, error, match in [({"capacity": 0}, ValueError, "DynamicEmbedding: `capacity`"),
                                 ({"capacity": 3, "capacity_policy": "mru"}, ValueError, "`capacity_policy`"),
                                 ({"admission": 2}, TypeError, "AdmitAfter"),
                                 ({"num_embeddings": 0}, ValueError, "`num_embeddings`")]:
        with pytest.raises(error, match=match):
            DynamicEmbedding(DIM, **kwargs)
