"""Types of ``unison._cluster``'s names, for type checkers; ``__init__.py`` loads each on first use."""


from . import env, multi_worker_util
from .base import ClusterResolver, format_master_url
from .detect import ENVIRONMENTS, detect_cluster_resolver
from .kubernetes import KubernetesClusterResolver
from .sagemaker import SageMakerClusterResolver
from .scheduler import Scheduler
from .simple import SimpleClusterResolver
from .slurm import SlurmClusterResolver, expand_hostlist, expand_tasks_per_node, rendezvous_port
from .spec import ClusterSpec, split_address
from .tf_config import TFConfig, TFConfigClusterResolver, parse_tf_config, read_tf_config
from .threads import ThreadsDefaultWarning
from .torchrun import TorchrunClusterResolver
from .union import UnionResolver, merge_clusters

__all__ = [
    "ClusterSpec",
    "ClusterResolver",
    "Scheduler",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "SlurmClusterResolver",
    "SimpleClusterResolver",
    "UnionResolver",
    "KubernetesClusterResolver",
    "SageMakerClusterResolver",
    "merge_clusters",
    "rendezvous_port",
    "ThreadsDefaultWarning",
    "detect_cluster_resolver",
    "ENVIRONMENTS",
    "TFConfig",
    "parse_tf_config",
    "read_tf_config",
    "expand_hostlist",
    "expand_tasks_per_node",
    "split_address",
    "format_master_url",
    "multi_worker_util",
    "env",
]
