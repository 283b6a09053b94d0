"""Chooses the cluster resolver for this process, in one explicit order.

Order: an explicit resolver; ``TF_CONFIG``; torchrun's variables; SLURM's variables;
SageMaker's variables; else local training (an empty cluster). Naming an environment
(``"torchrun"``) that is not present raises instead of quietly falling back to local
training, so a job that was meant to be distributed never trains alone by mistake.

Why this order: each later environment can surround an earlier one, and the inner one
describes the processes that really train. ``unison launch`` writes ``TF_CONFIG`` for
its children, and torchrun its variables, also when they run inside an ``srun`` step or
a SageMaker container, whose variables the children inherit; a TFJob on Kubernetes sets
``TF_CONFIG``. SLURM comes before SageMaker because SageMaker HyperPod clusters run
SLURM. Kubernetes is never detected: its resolver cannot tell which pod it runs in, so
a program that uses it creates it and sets ``task_type``/``task_id`` itself (on
Kubernetes, TFJob's ``TF_CONFIG`` is the detected path).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from unison._cluster.base import ClusterResolver
from unison._cluster.env import TF_CONFIG
from unison._cluster.sagemaker import SageMakerClusterResolver
from unison._cluster.simple import SimpleClusterResolver
from unison._cluster.slurm import SlurmClusterResolver
from unison._cluster.tf_config import TFConfigClusterResolver
from unison._cluster.torchrun import TorchrunClusterResolver
from unison.errors import ClusterError

__all__ = ["ENVIRONMENTS", "detect_cluster_resolver"]


#: The environments walked by ``detect_cluster_resolver``, in order:
#: (name, presence test, resolver factory, the variables that mark it).
ENVIRONMENTS: tuple[tuple[str, Callable[..., bool], Callable[..., ClusterResolver], str], ...] = (
    ("tf_config", TFConfigClusterResolver.is_present, lambda environ: TFConfigClusterResolver(environ=environ),
     TF_CONFIG),
    ("torchrun", TorchrunClusterResolver.is_present, lambda environ: TorchrunClusterResolver(environ=environ),
     "RANK, WORLD_SIZE"),
    ("slurm", SlurmClusterResolver.is_present, lambda environ: SlurmClusterResolver(environ=environ),
     "SLURM_PROCID, SLURM_NTASKS"),
    ("sagemaker", SageMakerClusterResolver.is_present, lambda environ: SageMakerClusterResolver(environ=environ),
     "SM_HOSTS, SM_CURRENT_HOST"),
)


def detect_cluster_resolver(
    resolver: ClusterResolver | str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> ClusterResolver:
    """Returns the resolver for this process.

    Args:
        resolver: a ClusterResolver (returned as is); or the name of an environment that
            must be present: ``"tf_config"``, ``"torchrun"``, ``"slurm"``, ``"sagemaker"`` or
            ``"local"``;
            or None to take the first present environment in ``ENVIRONMENTS`` order, else
            local training.
        environ: the environment to inspect (default ``os.environ``); the resolver
            returned reads the same one.

    Returns:
        A ClusterResolver; for local training a SimpleClusterResolver with an empty cluster.

    Raises:
        ClusterError: if a named environment is not present.
        ValueError: if ``resolver`` is an unknown name.
        TypeError: if ``resolver`` is neither a ClusterResolver, a string nor None.
    """
    if isinstance(resolver, ClusterResolver):
        return resolver
    if resolver is not None and not isinstance(resolver, str):
        raise TypeError(
            f"resolver must be a ClusterResolver, a name or None, got {type(resolver).__name__}: {resolver!r}"
        )
    names = [name for name, *_ in ENVIRONMENTS] + ["local"]
    if resolver is not None and resolver not in names:
        raise ValueError(f"unknown cluster environment {resolver!r}; use one of {names!r}")
    if resolver == "local":
        return SimpleClusterResolver()
    for name, present, make, markers in ENVIRONMENTS:
        if resolver not in (None, name):
            continue
        if present(environ):
            return make(environ)
        if resolver == name:
            raise ClusterError(
                f"cluster environment {name!r} was requested but is not present ({markers} not set); "
                f"start the program under it, or pass resolver=None to detect the environment"
            )
    return SimpleClusterResolver()
