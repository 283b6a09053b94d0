"""The distributed dataset of ``experimental_distribute_dataset``.

A distributed dataset lives on one worker. It knows the worker's place (``num_workers``,
``worker_index``), its local replica ``devices`` and, when workers may see different
numbers of batches, an ``agree`` callable from the strategy that tells whether every
worker has data for a step. Iterating it gives a
:class:`~unison._input.iterator.DistributedIterator`.

The invariant, whatever the policy: one step consumes one global batch across the
cluster, so each replica's batch has ``global_batch_size / num_replicas_in_sync`` rows
(the last batch is split as evenly as possible, a replica may get 0 rows).
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, default_collate

from unison._input._checks import require_int
from unison._input._common import OnePass, Placement, forward_set_epoch, is_map_style, sized_len
from unison._input.context import AutoShardPolicy, InputOptions, InputReplicationMode
from unison._input.from_function import DistributedDatasetsFromFunction
from unison._input.iterator import DistributedIterator
from unison._input.pipelines import check_min_rows, data_shard_steps, rebatch_steps, worker_batch_steps
from unison._input.sampler import EmptySafeCollate, ShardedBatchSampler
from unison._input.sharding import exposes_files, shard_files
from unison._input.structure import slice_batch

# DistributedDatasetsFromFunction lives in from_function.py (size); re-exported so both
# distributed dataset kinds come from this module.
__all__ = ["DistributedDataset", "DistributedDatasetsFromFunction"]

_LOADER_KEYS_WE_SET = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


class DistributedDataset(metaclass=abc.ABCMeta):  # noqa: B024 - concrete; ABCMeta for register() only
    """A dataset of global batches, sharded across workers and split across local replicas.

    Accepts (1) any iterable that yields batches of the *global* batch size (a
    DataLoader, a list, a generator): tensors or nested dicts / tuples of tensors; or
    (2) a map-style ``torch.utils.data.Dataset`` with ``global_batch_size``, which is
    sampled here so that every worker loads only its own rows.

    Sharding (``options.auto_shard_policy``): ``DATA`` gives worker ``w`` its rows of
    every global batch; ``FILE`` (datasets exposing ``files`` / ``with_files``, see
    :mod:`unison._input.sharding`) gives it every ``W``-th file; ``OFF`` gives every worker
    all data; ``AUTO`` is ``FILE`` when the dataset exposes at least ``W`` files, else
    ``DATA``. Each worker's batch is split as evenly as possible across its replicas.
    Under ``DATA`` every worker reads the whole stream and keeps its rows (as in
    TensorFlow); to load only a worker's own rows, pass a map-style Dataset with
    ``global_batch_size``, expose files, or use ``distribute_datasets_from_function``.

    Equivalent: the result of ``tf.distribute.Strategy.experimental_distribute_dataset``.
    Differences: map-style Datasets are accepted with ``global_batch_size``; ``set_epoch``
    reshuffles them; one-shot iterators can be iterated once.

    ``isinstance(ds, DistributedDataset)`` is also True for the result of
    ``distribute_datasets_from_function``, as ``tf.distribute.DistributedDataset`` is for
    both: :class:`DistributedDatasetsFromFunction` is registered as a virtual subclass
    (``abc.ABCMeta.register``), since this class is constructed directly and so cannot be
    an abstract base, and only abstract classes are subclassed here. What both kinds
    offer: iteration (a :class:`~unison._input.iterator.DistributedIterator`),
    ``set_epoch`` and ``options``; ``shard_policy`` and ``len`` are this kind's only.

    Args:
        dataset: an iterable of global batches, or a map-style Dataset (with
            ``global_batch_size``).
        devices: canonical names of this worker's replica devices, in replica order.
        num_workers: workers in the cluster.
        worker_index: this worker, in ``range(num_workers)``.
        options: delivery and shard options; ``InputOptions()`` when None.
        global_batch_size: rows per step across the cluster; map-style Datasets only.
        agree: ``agree(local_has_data) -> bool``, True only if every worker has data;
            used where workers may see different numbers of batches (FILE, OFF, DATA
            over an iterable without ``len``). None: no communication.
        shuffle: map-style only: reshuffle each epoch (seeded, the same on all workers).
            Default True.
        seed: map-style only: base seed of the shuffle. Default 0.
        drop_last: map-style only: drop the last, smaller global batch. Default False.
        loader_kwargs: map-style only: further ``DataLoader`` arguments (``num_workers``,
            ``collate_fn``, ``pin_memory``, ...), not the batching ones.

    Raises:
        TypeError: for a dataset of the wrong kind or arguments of the wrong type.
        ValueError: for inconsistent arguments (see the messages: each names the fix).

    Example:
        Worker 1 of 2, with two local replicas, gets rows 4..7 of a global batch of 8:

        >>> import torch
        >>> ds = DistributedDataset([torch.arange(8)], devices=["cpu:0", "cpu:1"], num_workers=2, worker_index=1)
        >>> [t.tolist() for t in next(iter(ds)).values]
        [[4, 5], [6, 7]]
    """

    def __init__(
        self,
        dataset: Any,
        *,
        devices: Sequence[str | torch.device],
        num_workers: int = 1,
        worker_index: int = 0,
        options: InputOptions | None = None,
        global_batch_size: int | None = None,
        agree: Callable[[bool], bool] | None = None,
        shuffle: bool | None = None,
        seed: int | None = None,
        drop_last: bool | None = None,
        loader_kwargs: Mapping[str, Any] | None = None,
    ):
        self._placement = p = Placement(num_workers, worker_index, devices, options, agree)
        if p.options.experimental_replication_mode is not InputReplicationMode.PER_WORKER:
            raise ValueError(
                "InputOptions(experimental_replication_mode=PER_REPLICA) is only supported by "
                "distribute_datasets_from_function; use PER_WORKER with experimental_distribute_dataset"
            )
        map_args = {"shuffle": shuffle, "seed": seed, "drop_last": drop_last, "loader_kwargs": loader_kwargs}
        self._sampler: ShardedBatchSampler | None = None
        self._loader_generator: torch.Generator | None = None
        self._sampler_seed = 0 if seed is None else int(seed)
        self._source: Any = None  # what a pass iterates: the dataset, a file shard, or our DataLoader
        self._policy = AutoShardPolicy.DATA
        self._make_steps: Callable[[], Iterator[list[Any]]]
        self._needs_agree = False
        self._len: int | None = None
        if is_map_style(dataset):
            self._init_map_style(dataset, global_batch_size, map_args)
        else:
            self._init_iterable(dataset, global_batch_size, map_args)
        self._passes = OnePass(self._source, "the dataset")

    @property
    def shard_policy(self) -> AutoShardPolicy:
        """The policy in effect on this worker (``AUTO`` resolved to ``FILE`` or ``DATA``)."""
        return self._policy

    @property
    def options(self) -> InputOptions:
        """The input options this dataset delivers with."""
        return self._placement.options

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch of the next pass: reshuffles a map-style Dataset reproducibly.

        For an iterable, forwards to its ``set_epoch`` (or its DataLoader sampler's) when
        it has one; otherwise does nothing, so one training loop serves every input kind.
        """
        require_int("epoch", epoch, minimum=0)
        if self._loader_generator is not None:
            self._loader_generator.manual_seed(self._sampler_seed * 1_000_003 + epoch)
        if self._sampler is not None:
            self._sampler.set_epoch(epoch)
        else:
            forward_set_epoch(self._source, epoch)

    def __iter__(self) -> DistributedIterator:
        self._passes.start()
        return self._placement.iterator(self._make_steps(), needs_agree=self._needs_agree)

    def __len__(self) -> int:
        if self._len is None:
            raise TypeError(
                f"the number of steps of this distributed dataset is unknown (policy {self._policy.name}, "
                f"dataset {type(self._source).__name__}); iterate it to the end instead"
            )
        return self._len

    # -- construction --------------------------------------------------------------

    def _init_map_style(self, dataset: Any, global_batch_size: Any, args: dict[str, Any]) -> None:
        p = self._placement
        if global_batch_size is None:
            raise TypeError(
                f"a map-style Dataset ({type(dataset).__name__}) yields samples, not batches: pass "
                f"`global_batch_size=` to distribute it, or pass a DataLoader batched with the global batch size"
            )
        batch = require_int("global_batch_size", global_batch_size, minimum=1)
        check_min_rows(batch, p.num_workers, p.num_replicas, what="`global_batch_size`")
        if batch % p.num_workers:
            raise ValueError(
                f"`global_batch_size` {batch} is not divisible by the number of workers {p.num_workers}: "
                f"each worker loads global_batch_size / num_workers samples per step; use a multiple of "
                f"{p.num_workers}"
            )
        policy = p.options.auto_shard_policy
        if policy is AutoShardPolicy.FILE:
            raise ValueError(
                "auto_shard_policy=FILE needs a dataset exposing `files` and `with_files`; a map-style "
                "Dataset is sharded by sample: use AUTO or DATA (or OFF)"
            )
        self._policy = AutoShardPolicy.OFF if policy is AutoShardPolicy.OFF else AutoShardPolicy.DATA
        off = self._policy is AutoShardPolicy.OFF
        kwargs = dict(args["loader_kwargs"] or {})
        clashes = sorted(k for k in kwargs if k in _LOADER_KEYS_WE_SET)
        if clashes:
            raise ValueError(
                f"`loader_kwargs` sets {clashes}, which the distributed dataset decides: use "
                f"`global_batch_size`, `shuffle` and `drop_last` instead"
            )
        collate = kwargs.pop("collate_fn", None) or default_collate
        # The loader draws a base seed (for its worker processes) at every pass: from a
        # generator of its own, reseeded by set_epoch, so that making an iterator neither
        # takes numbers from the training's global generator (dropout would see other
        # masks after a restart that made the iterator at another point) nor differs
        # between a first run and a resumed one.
        if "generator" not in kwargs:
            self._loader_generator = kwargs["generator"] = torch.Generator().manual_seed(
                0 if args["seed"] is None else args["seed"])
        self._sampler = ShardedBatchSampler(
            len(dataset),
            batch // p.num_workers if off else batch,
            num_workers=1 if off else p.num_workers,
            worker_index=0 if off else p.worker_index,
            shuffle=True if args["shuffle"] is None else bool(args["shuffle"]),
            seed=0 if args["seed"] is None else args["seed"],
            drop_last=bool(args["drop_last"]),
        )
        self._source = DataLoader(
            dataset, batch_sampler=self._sampler, collate_fn=EmptySafeCollate(collate), **kwargs
        )
        sampler = self._sampler

        def make_empty() -> Any:
            return slice_batch(collate([dataset[sampler.order()[0]]]), slice(0, 0))

        self._make_steps = lambda: worker_batch_steps(self._source, num_replicas=p.num_replicas, make_empty=make_empty)
        self._needs_agree = False
        self._len = len(self._sampler)

    def _init_iterable(self, dataset: Any, global_batch_size: Any, args: dict[str, Any]) -> None:
        p = self._placement
        if global_batch_size is not None:
            raise ValueError(
                f"`global_batch_size` is only for map-style Datasets; {type(dataset).__name__} must already "
                f"yield batches of the global batch size"
            )
        given = sorted(name for name, value in args.items() if value is not None)
        if given:
            raise ValueError(
                f"{given} only apply to map-style Datasets with `global_batch_size`; for "
                f"{type(dataset).__name__}, set them where its batches are made (e.g. on the DataLoader)"
            )
        if isinstance(dataset, (torch.Tensor, str, bytes, Mapping)) or not isinstance(dataset, Iterable):
            raise TypeError(
                f"experimental_distribute_dataset needs an iterable of global batches (a DataLoader, a list, "
                f"a generator) or a map-style Dataset with `global_batch_size=`; got {type(dataset).__name__}"
            )
        self._policy = self._resolve_policy(dataset)
        if isinstance(dataset, DataLoader):
            self._check_loader(dataset)
        W, R = p.num_workers, p.num_replicas
        if self._policy is AutoShardPolicy.FILE:
            shardable: Any = dataset  # follows the file protocol (checked by _resolve_policy)
            self._source = shardable.with_files(shard_files(shardable.files, W, p.worker_index))
            if not isinstance(self._source, Iterable):
                raise TypeError(
                    f"{type(dataset).__name__}.with_files(files) returned {type(self._source).__name__}, not an "
                    f"iterable of batches"
                )
        else:
            self._source = dataset
        size = sized_len(self._source)
        if self._policy is AutoShardPolicy.DATA:
            self._make_steps = lambda: data_shard_steps(
                self._source, num_workers=W, worker_index=p.worker_index, num_replicas=R
            )
            self._needs_agree = size is None
            self._len = size
        else:
            self._make_steps = lambda: rebatch_steps(self._source, num_workers=W, num_replicas=R)
            self._needs_agree = True
            self._len = W * size if size is not None and self._policy is AutoShardPolicy.OFF else None

    def _resolve_policy(self, dataset: Any) -> AutoShardPolicy:
        p = self._placement
        policy = p.options.auto_shard_policy
        if policy is AutoShardPolicy.FILE and not exposes_files(dataset):
            raise ValueError(
                f"auto_shard_policy=FILE but {type(dataset).__name__} does not expose files: it needs a "
                f"`files` sequence and a `with_files(files)` method; use DATA (or AUTO) instead"
            )
        if policy is AutoShardPolicy.AUTO:
            if p.num_workers > 1 and exposes_files(dataset) and len(list(dataset.files)) >= p.num_workers:
                return AutoShardPolicy.FILE
            return AutoShardPolicy.DATA
        return policy

    def _check_loader(self, loader: DataLoader) -> None:
        p = self._placement
        if loader.batch_size is not None:
            check_min_rows(loader.batch_size, p.num_workers, p.num_replicas, what="the DataLoader's `batch_size`")
        if p.num_workers == 1 or self._policy is not AutoShardPolicy.DATA:
            return
        if isinstance(loader.sampler, DistributedSampler):
            raise ValueError(
                "the DataLoader already shards with a DistributedSampler, and DATA sharding would shard it "
                "again: pass the Dataset itself with `global_batch_size=`, or build per-worker loaders in "
                "distribute_datasets_from_function"
            )
        if isinstance(loader.sampler, RandomSampler) and loader.sampler.generator is None:
            warnings.warn(
                "the DataLoader shuffles with an unseeded RandomSampler: under DATA sharding every worker must "
                "read the same order, or samples are repeated and missed; pass "
                "`generator=torch.Generator().manual_seed(seed)` to the DataLoader, or pass the Dataset itself "
                "with `global_batch_size=`",
                UserWarning,
                stacklevel=4,
            )


# tf.distribute.DistributedDataset covers both kinds; see the class docstring.
DistributedDataset.register(DistributedDatasetsFromFunction)
