"""Types of unison's public API, for type checkers; at run time ``__init__.py`` loads each name
on first use (``lazy_loader.attach_stub`` reads this file's imports)."""

from . import coordinator, embeddings, errors, optim, partitioners, placement, progress, tensorpack
from ._checkpoint import (
    BackupAndRestore,
    PreemptionCheckpointHandler,
    SidecarEvaluator,
    TerminationConfig,
    load_checkpoint,
    mark_final,
    remove_temp_dir_with_filepath,
    remove_temp_dirpath,
    save_checkpoint,
    save_step_checkpoint,
    write_dirpath,
    write_filepath,
)
from ._cluster import (
    ClusterResolver,
    ClusterSpec,
    KubernetesClusterResolver,
    SageMakerClusterResolver,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    ThreadsDefaultWarning,
    TorchrunClusterResolver,
    UnionResolver,
    detect_cluster_resolver,
)
from ._collectives.ops.base import CrossDeviceOps
from ._collectives.ops.collective import CollectiveAllReduce
from ._collectives.ops.local import (
    AllReduceCrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
    select_cross_device_ops,
)
from ._collectives.options import CommunicationImplementation, CommunicationOptions, Compression, PowerSGD
from ._context import ReplicaContext
from ._embeddings.modules.dynamic_embedding import DynamicEmbedding
from ._input import (
    AutoShardPolicy,
    DistributedDataset,
    DistributedDatasetsFromFunction,
    DistributedIterator,
    InputContext,
    InputOptions,
    InputReplicationMode,
    OptionalValue,
    ValueContext,
)
from ._ps.chief.cluster_coordinator import ClusterCoordinator
from ._ps.chief.remote_values import PerWorkerValues, RemoteValue
from ._ps.hybrid_strategy import HybridParameterServerStrategy
from ._ps.remote_variables.ps_variables import ShardedVariable
from ._ps.strategy import ParameterServerStrategy
from ._ps.task_server import Server
from ._reduce import ReduceOp
from ._strategies.base import Strategy, StrategyExtended
from ._strategies.central_storage import CentralStorageStrategy
from ._strategies.creation import Variable
from ._strategies.current import (
    experimental_set_strategy,
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from ._strategies.mirrored import MirroredStrategy
from ._strategies.multi_worker import CollectiveAllReduceStrategy, MultiWorkerMirroredStrategy
from ._strategies.one_device import OneDeviceStrategy
from ._values.aggregation import VariableAggregation, VariableSynchronization
from ._values.values import DistributedValues, Mirrored, PerReplica
from ._values.variables import MirroredVariable, SyncOnReadVariable

__version__: str

__all__ = [
    "BackupAndRestore",
    "PreemptionCheckpointHandler",
    "SidecarEvaluator",
    "TerminationConfig",
    "coordinator",
    "errors",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "OptionalValue",
    "ValueContext",
    "experimental_set_strategy",
    "ClusterCoordinator",
    "ParameterServerStrategy",
    "HybridParameterServerStrategy",
    "DynamicEmbedding",
    "PerWorkerValues",
    "RemoteValue",
    "Server",
    "ShardedVariable",
    "partitioners",
    "embeddings",
    "optim",
    "ClusterResolver",
    "UnionResolver",
    "KubernetesClusterResolver",
    "SageMakerClusterResolver",
    "ThreadsDefaultWarning",
    "ClusterSpec",
    "CollectiveAllReduce",
    "CollectiveAllReduceStrategy",
    "CommunicationImplementation",
    "Compression",
    "PowerSGD",
    "CommunicationOptions",
    "MultiWorkerMirroredStrategy",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "detect_cluster_resolver",
    "save_checkpoint",
    "load_checkpoint",
    "save_step_checkpoint",
    "mark_final",
    "write_dirpath",
    "write_filepath",
    "remove_temp_dirpath",
    "remove_temp_dir_with_filepath",
    "AllReduceCrossDeviceOps",
    "AutoShardPolicy",
    "CentralStorageStrategy",
    "CrossDeviceOps",
    "DistributedValues",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Mirrored",
    "MirroredStrategy",
    "MirroredVariable",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "Strategy",
    "StrategyExtended",
    "SyncOnReadVariable",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "placement",
    "progress",
    "tensorpack",
    "select_cross_device_ops",
]
