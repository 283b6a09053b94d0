"""unison: tf.distribute-style distribution strategies for PyTorch, on torch.distributed.

The same training step runs on one device (OneDeviceStrategy), on several devices of
one machine (MirroredStrategy, CentralStorageStrategy) and on a cluster
(MultiWorkerMirroredStrategy). See README.md for a tour.
"""

import sys as _sys
from unison import checkpoint
from unison.checkpoint import (
    BackupAndRestore,
    PreemptionCheckpointHandler,
    SidecarEvaluator,
    TerminationConfig,
    load_checkpoint,
    save_checkpoint,
)
from unison.cluster import (
    ClusterResolver,
    KubernetesClusterResolver,
    SageMakerClusterResolver,
    UnionResolver,
    ThreadsDefaultWarning,
    ClusterSpec,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    detect_cluster_resolver,
)
from unison.collectives.base import CrossDeviceOps
from unison.collectives.collective import CollectiveAllReduce
from unison.collectives.options import CommunicationImplementation, CommunicationOptions, Compression, PowerSGD
from unison.collectives.local import (
    AllReduceCrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
    select_cross_device_ops,
)
from unison.context import ReplicaContext
from unison.coordinator import (
    CoordinatorMode,
    WorkerContext,
    get_current_worker_context,
    run_distribute_coordinator,
    run_standard_server,
)
from unison import placement
from unison.input import (
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
from unison.ps import partitioners

# `import unison.partitioners` (tf.distribute.experimental.partitioners' spelling) finds
# the module that `unison.partitioners` names.
_sys.modules.setdefault(f"{__name__}.partitioners", partitioners)
from unison.strategies.cluster_coordinator import ClusterCoordinator
from unison.ps.server import Server
from unison.ps.values import PerWorkerValues, RemoteValue
from unison.ps.variables import ShardedVariable
from unison.reduce import ReduceOp
from unison.strategies.base import Strategy, StrategyExtended
from unison.strategies.central_storage import CentralStorageStrategy
from unison.strategies.creation import Variable
from unison.strategies.current import (
    get_cross_replica_context,
    get_replica_context,
    experimental_set_strategy,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from unison.strategies.mirrored import MirroredStrategy
from unison.strategies.multi_worker import CollectiveAllReduceStrategy, MultiWorkerMirroredStrategy
from unison.strategies.one_device import OneDeviceStrategy
from unison.strategies.parameter_server import ParameterServerStrategy
from unison.values.aggregation import VariableAggregation, VariableSynchronization
from unison.values.values import DistributedValues, Mirrored, PerReplica
from unison.values.variables import MirroredVariable, SyncOnReadVariable

__version__ = "0.1.0"

__all__ = [
    "BackupAndRestore",
    "PreemptionCheckpointHandler",
    "SidecarEvaluator",
    "TerminationConfig",
    "checkpoint",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "OptionalValue",
    "ValueContext",
    "experimental_set_strategy",
    "ClusterCoordinator",
    "ParameterServerStrategy",
    "PerWorkerValues",
    "RemoteValue",
    "Server",
    "ShardedVariable",
    "partitioners",
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
