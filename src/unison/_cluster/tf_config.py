"""TF_CONFIG: the cluster description of Kubeflow TFJob, Vertex AI, SageMaker and ``unison launch``.

``TF_CONFIG`` is JSON::

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
     "task": {"type": "worker", "index": 1},
     "rpc_layer": "tcp"}

It is parsed strictly: every mistake raises ``ValueError`` naming the field, the bad
value and the fix, before any process group forms.

Unknown keys, decided per place (TensorFlow ignores them all):

- in ``task``: a ``ValueError`` naming the nearest of ``type`` / ``index`` (``"id"``: did
  you mean ``index``?). A task has two settings; a misspelled ``index`` silently made
  every such task index 0 (two "worker 0"s then fail far from the cause). ``trial`` and
  ``cloud``, which AI Platform / Vertex AI add, are accepted and ignored.
- at the top level: a ``ValueError`` when the key is a near miss of ``cluster``,
  ``task``, ``rpc_layer`` or ``environment`` (``"rpclayer"``), whose setting would
  otherwise be lost; any other key only warns (``UserWarning``), since schedulers add
  keys of their own. ``job`` (AI Platform / Vertex AI's job spec) is accepted silently.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

from unison._cluster import env, multi_worker_util
from unison._cluster.base import ClusterResolver, local_accelerators, task_master_url
from unison._cluster.known_schedulers import scheduler_named
from unison._cluster.resolved import ResolvedCluster
from unison._cluster.scheduler import Scheduler
from unison._cluster.spec import ClusterLike, ClusterSpec

__all__ = ["TFConfig", "parse_tf_config", "read_tf_config", "TFConfigClusterResolver", "resolve_task"]

_EMPTY_OBJECT = re.compile(r"\s*\{\s*\}\s*")

_KEYS = ("cluster", "task", "rpc_layer", "environment")
_IGNORED_KEYS = ("job",)  # AI Platform / Vertex AI: the job's own spec
_TASK_KEYS = ("type", "index")
_IGNORED_TASK_KEYS = ("trial", "cloud")  # AI Platform / Vertex AI: tuning trial, cloud name


def _check_top_level_keys(config: Mapping[str, Any]) -> list[str]:
    """Near misses of a known key raise; returns the other unknown keys, to warn about."""
    unknown = sorted(set(config) - set(_KEYS) - set(_IGNORED_KEYS), key=str)
    for key in unknown:
        nearest = difflib.get_close_matches(str(key), _KEYS, n=1)
        if nearest:
            raise ValueError(
                f"TF_CONFIG has an unknown key {key!r}; did you mean `{nearest[0]}`? "
                f"Fix the key (known keys: {', '.join(_KEYS)})"
            )
    return unknown


def _check_task_keys(task: Mapping[str, Any]) -> None:
    """Every unknown key of ``task`` raises, naming the nearest known key."""
    unknown = sorted(set(task) - set(_TASK_KEYS) - set(_IGNORED_TASK_KEYS), key=str)
    if unknown:
        key = unknown[0]
        # The key it most likely stands for: the one missing, else the closer spelling.
        missing = [k for k in _TASK_KEYS if k not in task]
        candidates = missing if len(missing) == 1 else _TASK_KEYS
        nearest = max(candidates, key=lambda k: difflib.SequenceMatcher(None, str(key).lower(), k).ratio())
        raise ValueError(
            f"TF_CONFIG `task` {task!r} has an unknown key {key!r}; did you mean `{nearest}`? "
            f"Fix `task.{key}` (a task has `type` and `index`, e.g. {{\"type\": \"worker\", \"index\": 1}})"
        )


@dataclasses.dataclass(frozen=True)
class TFConfig:
    """A parsed and validated ``TF_CONFIG``.

    Attributes:
        cluster: the cluster (empty for ``"cluster": {}``).
        task_type: the task's type, or None when ``task`` is absent (a client).
        task_id: the task's index (``task.index``, default 0), or None without ``task``.
        rpc_layer: ``rpc_layer`` if given.
        environment: ``environment`` if given.
    """

    cluster: ClusterSpec
    task_type: str | None = None
    task_id: int | None = None
    rpc_layer: str | None = None
    environment: str | None = None


def _optional_str(config: Mapping[str, Any], key: str) -> str | None:
    value = config.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"TF_CONFIG `{key}` is {value!r}, not a string; fix `{key}`, e.g. \"tcp\"")
    return value


def parse_tf_config(text: str, *, require_task: bool = False) -> TFConfig:
    """Parses and validates the text of a ``TF_CONFIG``.

    Args:
        text: the JSON text.
        require_task: whether ``task`` must be present (every task of a cluster needs
            it; only a standalone client may omit it).

    Returns:
        The parsed config.

    Raises:
        ValueError: if the text is not JSON, is not an object, lacks ``cluster`` (or
            ``task`` when required), or breaks a cluster rule; the message names the
            field and the bad value.
    """
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON ({e.msg} at char {e.pos}): {text!r}; fix its syntax") from e
    if config == {} and not require_task:
        return TFConfig(ClusterSpec({}))  # "{}" is how some schedulers say "no cluster"
    if not isinstance(config, dict):
        raise ValueError(
            f"TF_CONFIG is a JSON {type(config).__name__} {config!r}, not an object like "
            f'{{"cluster": {{...}}, "task": {{...}}}}; fix TF_CONFIG'
        )
    for key in _check_top_level_keys(config):
        warnings.warn(
            f"TF_CONFIG has an unknown key {key!r}, which unison ignores (known keys: "
            f"{', '.join(_KEYS)}); remove it if it was meant as one of them",
            UserWarning,
            stacklevel=2,
        )
    if "cluster" not in config:
        raise ValueError(
            f"TF_CONFIG has no `cluster` (keys: {sorted(config)!r}); add "
            f'"cluster": {{"worker": ["host:port", ...]}}'
        )
    cluster = config["cluster"]
    if not isinstance(cluster, dict):
        raise ValueError(
            f"TF_CONFIG `cluster` is {cluster!r}, not an object of job name -> addresses; "
            f'fix `cluster`, e.g. {{"worker": ["host:port"]}}'
        )
    try:
        spec = ClusterSpec(cluster)
    except ValueError as e:
        raise ValueError(f"TF_CONFIG {e}") from None
    multi_worker_util.validate_cluster_spec(spec, None, None, source="TF_CONFIG ")
    rpc_layer = _optional_str(config, "rpc_layer")
    environment = _optional_str(config, "environment")
    task = config.get("task")
    if task is None:
        if require_task:
            raise ValueError(
                f"TF_CONFIG has no `task` (keys: {sorted(config)!r}): each task of the cluster "
                f'must say which it is; add "task": {{"type": "worker", "index": 0}}'
            )
        return TFConfig(spec, None, None, rpc_layer, environment)
    if not isinstance(task, dict):
        raise ValueError(
            f'TF_CONFIG `task` is {task!r}, not an object; fix `task`, e.g. {{"type": "worker", "index": 0}}'
        )
    _check_task_keys(task)
    if "type" not in task:
        raise ValueError(f"TF_CONFIG `task` {task!r} has no `type`; add `task.type`, e.g. \"worker\"")
    task_type = task["type"]
    if not isinstance(task_type, str):
        raise ValueError(f"TF_CONFIG task type {task_type!r} is not a string; fix `task.type`, e.g. \"worker\"")
    task_id = task.get("index", 0)
    multi_worker_util.validate_cluster_spec(
        spec, task_type, task_id, source="TF_CONFIG ", type_field="task.type", id_field="task.index"
    )
    return TFConfig(spec, task_type, task_id, rpc_layer, environment)


def read_tf_config(environ: Mapping[str, str] | None = None, *, require_task: bool = False) -> TFConfig | None:
    """Parses ``TF_CONFIG`` from the environment; None when it is unset or blank.

    ``"{}"`` parses as the empty cluster of local training.

    Raises:
        ValueError: as ``parse_tf_config``.
    """
    text = (os.environ if environ is None else environ).get(env.TF_CONFIG, "")
    if not text.strip():
        return None
    return _parse_cached(text, require_task)


@functools.lru_cache(maxsize=8)
def _parse_cached(text: str, require_task: bool) -> TFConfig:
    # The value is frozen, so one parse serves every reader of the same TF_CONFIG text;
    # a changed environment is a new text, parsed anew.
    return parse_tf_config(text, require_task=require_task)


class TFConfigClusterResolver(ClusterResolver):
    """Resolves the cluster from the ``TF_CONFIG`` environment variable.

    ``TF_CONFIG`` is read on every call, so a change of the environment is seen.
    Explicit ``task_type``/``task_id``/``rpc_layer``/``environment`` override it. An
    unset ``TF_CONFIG`` is local training: an empty cluster and no task.

    tf.distribute equivalent: ``tf.distribute.cluster_resolver.TFConfigClusterResolver``.
    Difference: ``TF_CONFIG`` is validated strictly (a malformed one raises ValueError).

    Args:
        task_type: overrides ``task.type``.
        task_id: overrides ``task.index``.
        rpc_layer: overrides ``rpc_layer``.
        environment: overrides ``environment``.
        environ: the environment to read (default: ``os.environ`` at each call).
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ):
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment
        self._environ = environ

    @staticmethod
    def is_present(environ: Mapping[str, str] | None = None) -> bool:
        """Whether ``TF_CONFIG`` is set to something other than blanks or ``{}``.

        A malformed ``TF_CONFIG`` counts as present, so that its error is reported.
        """
        text = (os.environ if environ is None else environ).get(env.TF_CONFIG, "")
        return bool(text.strip()) and not _EMPTY_OBJECT.fullmatch(text)

    def _config(self) -> TFConfig:
        return read_tf_config(self._environ) or TFConfig(ClusterSpec({}))

    def cluster_spec(self) -> ClusterSpec:
        return self._config().cluster

    @property
    def task_type(self) -> str | None:
        return self._task_type if self._task_type is not None else self._config().task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        return self._task_id if self._task_id is not None else self._config().task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        return self._rpc_layer if self._rpc_layer is not None else self._config().rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str:
        return self._environment if self._environment is not None else (self._config().environment or "")

    @property
    def scheduler(self) -> Scheduler:
        """unison launch's conventions, or those of the scheduler ``environment`` names
        ("torchrun", "slurm": a job script that writes TF_CONFIG itself)."""
        return scheduler_named(self.environment)

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None) -> dict[str, int]:
        """CUDA devices of this machine: every task of a TF_CONFIG cluster sees its own host."""
        return local_accelerators()

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        return task_master_url(self, task_type, task_id, rpc_layer)


def resolve_task(
    cluster_spec: ClusterLike | None,
    task_type: str | None,
    task_id: int | None,
    rpc_layer: str | None,
    *,
    require_task: bool = False,
    environ: Mapping[str, str] | None = None,
) -> ResolvedCluster:
    """The distribute coordinator's resolution: explicit arguments, completed from ``TF_CONFIG``.

    Explicit arguments win over ``TF_CONFIG`` (unlike the reference, where its task wins);
    ``TF_CONFIG``'s ``rpc_layer`` wins over the argument's default. The task type
    ``"client"`` means no task.

    Raises:
        ValueError: for a malformed cluster or ``TF_CONFIG``, a missing task when
            ``require_task``, or a cluster with neither a chief nor a worker.
    """
    environ = os.environ if environ is None else environ
    config = read_tf_config(environ)
    environment = ""
    if config is not None:
        environment = config.environment or ""
        if not cluster_spec:
            cluster_spec = config.cluster
        if task_type is None:
            task_type = config.task_type
            task_id = config.task_id if task_id is None else task_id
        if config.rpc_layer is not None:
            rpc_layer = config.rpc_layer
    spec = multi_worker_util.normalize_cluster_spec(cluster_spec)
    if not spec:
        return ResolvedCluster.build(spec, None, None, rpc_layer=rpc_layer, environment=environment,
                                     scheduler=scheduler_named(environment), environ=environ)
    if task_type == "client":
        task_type, task_id = None, None
    if task_type is not None and task_id is None:
        task_id = 0
    if require_task and task_type is None:
        raise ValueError(
            f"INDEPENDENT_WORKER mode needs this task's type and index (cluster {spec.as_dict()!r}); "
            f'set TF_CONFIG `task` (e.g. {{"type": "worker", "index": 0}}) or pass task_type/task_id'
        )
    multi_worker_util.leader_task(spec)  # there must be a chief or a worker
    return ResolvedCluster.build(spec, task_type, task_id, rpc_layer=rpc_layer, environment=environment,
                                 scheduler=scheduler_named(environment), environ=environ)
