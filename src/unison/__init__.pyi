"""Types of unison's public API, for type checkers; at run time ``__init__.py`` loads each name
on first use (``lazy_loader.attach_stub`` reads this file's imports)."""

from . import checkpoint, cluster, collectives, embeddings, errors, optim, partitioners, placement
from .checkpoint import (
    BackupAndRestore,
    PreemptionCheckpointHandler,
    SidecarEvaluator,
    TerminationConfig,
    load_checkpoint,
    save_checkpoint,
)
from .cluster import (
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
from .collectives.ops.base import CrossDeviceOps
from .collectives.ops.collective import CollectiveAllReduce
from .collectives.ops.local import (
    AllReduceCrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
    select_cross_device_ops,
)
from .collectives.options import CommunicationImplementation, CommunicationOptions, Compression, PowerSGD
from .context import ReplicaContext
from .coordinator import (
    CoordinatorMode,
    WorkerContext,
    get_current_worker_context,
    run_distribute_coordinator,
    run_standard_server,
)
from .embeddings.modules.dynamic_embedding import DynamicEmbedding
from .input import (
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
from .ps.chief.cluster_coordinator import ClusterCoordinator
from .ps.chief.remote_values import PerWorkerValues, RemoteValue
from .ps.hybrid_strategy import HybridParameterServerStrategy
from .ps.remote_variables.ps_variables import ShardedVariable
from .ps.strategy import ParameterServerStrategy
from .ps.task_server import Server
from .reduce import ReduceOp
from .strategies.base import Strategy, StrategyExtended
from .strategies.central_storage import CentralStorageStrategy
from .strategies.creation import Variable
from .strategies.current import (
    experimental_set_strategy,
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from .strategies.mirrored import MirroredStrategy
from .strategies.multi_worker import CollectiveAllReduceStrategy, MultiWorkerMirroredStrategy
from .strategies.one_device import OneDeviceStrategy
from .values.aggregation import VariableAggregation, VariableSynchronization
from .values.values import DistributedValues, Mirrored, PerReplica
from .values.variables import MirroredVariable, SyncOnReadVariable

__version__: str

__all__ = [
    "BackupAndRestore",
    "PreemptionCheckpointHandler",
    "SidecarEvaluator",
    "TerminationConfig",
    "checkpoint",
    "cluster",
    "collectives",
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
    "CoordinatorMode",
    "MultiWorkerMirroredStrategy",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "WorkerContext",
    "detect_cluster_resolver",
    "get_current_worker_context",
    "run_distribute_coordinator",
    "run_standard_server",
    "save_checkpoint",
    "load_checkpoint",
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
    "select_cross_device_ops",
]
