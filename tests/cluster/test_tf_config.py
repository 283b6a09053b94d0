"""TF_CONFIG parsing: valid configs, the resolver, and malformed configs naming field and value."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unison import ClusterSpec, TFConfigClusterResolver
from unison._cluster import parse_tf_config, read_tf_config

CLUSTER = {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]}


def _config(task=None, **extra):
    config = {"cluster": CLUSTER, **extra}
    if task is not None:
        config["task"] = task
    return json.dumps(config)


def test_parse_valid_config():
    config = parse_tf_config(_config({"type": "worker", "index": 1}, rpc_layer="tcp", environment="cloud"))
    assert config.cluster == ClusterSpec(CLUSTER)
    assert (config.task_type, config.task_id) == ("worker", 1)
    assert (config.rpc_layer, config.environment) == ("tcp", "cloud")


def test_index_defaults_to_zero_and_client_has_no_task():
    assert parse_tf_config(_config({"type": "chief"})).task_id == 0
    client = parse_tf_config(_config())
    assert (client.task_type, client.task_id) == (None, None)


def test_unset_or_blank_tf_config_is_local():
    assert read_tf_config({}) is None
    assert read_tf_config({"TF_CONFIG": "  "}) is None


# Each case: TF_CONFIG text, then fragments the message must contain: the field and the bad value.
MALFORMED = [
    ("not json", '{"cluster": ', ["not valid JSON", "'{\"cluster\": '"]),
    ("top level list", '["worker"]', ["JSON list", "['worker']"]),
    ("no cluster", '{"task": {"type": "worker", "index": 0}}', ["no `cluster`", "['task']"]),
    ("cluster is a list", '{"cluster": ["a:1"]}', ["`cluster` is ['a:1']"]),
    ("no task", _config(), ["no `task`", "['cluster']"]),
    ("task is a string", _config("worker"), ["`task` is 'worker'"]),
    ("task without type", _config({"index": 0}), ["no `type`", "{'index': 0}"]),
    ("type not a string", _config({"type": 1, "index": 0}), ["task type 1", "`task.type`"]),
    ("unknown task type", _config({"type": "master", "index": 0}), ["task type 'master'", "`task.type`"]),
    ("task type not in cluster", json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "ps", "index": 0}}),
     ["task type 'ps' is not a job", "`task.type`"]),
    ("index out of range", _config({"type": "worker", "index": 3}),
     ["task index 3 is out of range", "2 'worker' tasks (valid 0..1)", "`task.index`"]),
    ("negative index", _config({"type": "worker", "index": -1}), ["task index -1", "`task.index`"]),
    ("index is a string", _config({"type": "worker", "index": "1"}),
     ["task index '1' is not an integer", "`task.index`"]),
    ("index is a float", _config({"type": "worker", "index": 1.5}),
     ["task index 1.5 is not an integer", "`task.index`"]),
    ("index is a bool", _config({"type": "worker", "index": True}), ["task index True", "`task.index`"]),
    ("two chiefs", json.dumps({"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}}),
     ["2 'chief' tasks", "['a:1', 'b:1']", "`cluster.chief`"]),
    ("two evaluators", json.dumps({"cluster": {"worker": ["a:1"], "evaluator": ["e:1", "f:1"]}}),
     ["2 'evaluator' tasks", "`cluster.evaluator`"]),
    ("empty job", json.dumps({"cluster": {"worker": []}}), ["job 'worker' is empty", "`cluster.worker`"]),
    ("job is a string", json.dumps({"cluster": {"worker": "a:1"}}), ["job 'worker' is 'a:1'", "`cluster.worker`"]),
    ("address without port", json.dumps({"cluster": {"worker": ["localhost"]}}),
     ["'localhost'", "`cluster.worker[0]`"]),
    ("port not a number", json.dumps({"cluster": {"worker": ["a:1", "b:x"]}}),
     ["'b:x'", "port 'x'", "cluster.worker[1]"]),
    ("port out of range", json.dumps({"cluster": {"worker": ["a:99999"]}}), ["'a:99999'", "port '99999'"]),
    ("address not a string", json.dumps({"cluster": {"worker": [2222]}}), ["2222", "`cluster.worker[0]`"]),
    ("duplicate address", json.dumps({"cluster": {"worker": ["a:1", "a:1"]}}),
     ["'a:1'", "`cluster.worker[0]`", "`cluster.worker[1]`"]),
    ("one address spelled two ways", json.dumps({"cluster": {"worker": ["127.0.0.1:2222", "localhost:2222"]}}),
     ["'127.0.0.1:2222'", "'localhost:2222'", "`cluster.worker[0]`", "`cluster.worker[1]`", "worker:0 and worker:1",
      "another port"]),
    ("unknown job name", json.dumps({"cluster": {"trainer": ["a:1"]}}), ["job 'trainer'", "`cluster.trainer`"]),
    ("gap in task indices", json.dumps({"cluster": {"worker": {"0": "a:1", "2": "b:1"}}}),
     ["missing [1]", "`cluster.worker`"]),
    ("rpc_layer not a string", _config({"type": "worker", "index": 0}, rpc_layer=5), ["`rpc_layer` is 5"]),
]


@pytest.mark.parametrize("text, fragments", [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_malformed_tf_config_raises_value_error_naming_field_and_value(text, fragments):
    with pytest.raises(ValueError) as info:
        parse_tf_config(text, require_task=True)
    message = str(info.value)
    assert message.startswith("TF_CONFIG"), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_at_least_fifteen_malformed_cases():
    assert len(MALFORMED) >= 15


def test_resolver_reads_tf_config():
    environ = {"TF_CONFIG": _config({"type": "worker", "index": 1}, rpc_layer="tcp")}
    resolver = TFConfigClusterResolver(environ=environ)
    assert TFConfigClusterResolver.is_present(environ)
    assert resolver.cluster_spec() == ClusterSpec(CLUSTER)
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "tcp")
    assert resolver.master() == "tcp://w1:2222"
    assert resolver.master("chief", 0, rpc_layer="grpc") == "grpc://c:2222"
    assert resolver.num_accelerators()["GPU"] >= 0


def test_resolver_reads_the_environment_at_each_call():
    environ = {"TF_CONFIG": _config({"type": "worker", "index": 0})}
    resolver = TFConfigClusterResolver(environ=environ)
    assert resolver.task_id == 0
    environ["TF_CONFIG"] = _config({"type": "worker", "index": 1})
    assert resolver.task_id == 1


def test_explicit_arguments_override_tf_config():
    environ = {"TF_CONFIG": _config({"type": "worker", "index": 0}, rpc_layer="tcp")}
    resolver = TFConfigClusterResolver(task_type="ps", task_id=0, rpc_layer="grpc", environment="x", environ=environ)
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer, resolver.environment) == ("ps", 0, "grpc", "x")
    assert resolver.master() == "grpc://p0:2222"
    resolver.task_type, resolver.task_id = "worker", 1
    assert resolver.master() == "grpc://w1:2222"


def test_resolver_without_tf_config_is_local():
    resolver = TFConfigClusterResolver(environ={})
    assert not TFConfigClusterResolver.is_present({})
    assert resolver.cluster_spec() == ClusterSpec({})
    assert (resolver.task_type, resolver.task_id, resolver.master()) == (None, None, "")


def test_resolver_raises_on_malformed_tf_config():
    resolver = TFConfigClusterResolver(
        environ={"TF_CONFIG": '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 4}}'})
    with pytest.raises(ValueError, match="TF_CONFIG task index 4 is out of range"):
        resolver.cluster_spec()


_task_lists = st.lists(st.integers(1024, 65535), min_size=1, max_size=5, unique=True)


@given(workers=_task_lists, chief=st.booleans(), data=st.data())
def test_every_valid_config_parses_back(workers, chief, data):
    cluster = {"worker": [f"127.0.0.1:{p}" for p in workers]}
    if chief:
        cluster["chief"] = ["10.0.0.1:2222"]
    task_type = data.draw(st.sampled_from(sorted(cluster)))
    index = data.draw(st.integers(0, len(cluster[task_type]) - 1))
    config = parse_tf_config(json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}}))
    assert config.cluster.as_dict() == {k: cluster[k] for k in sorted(cluster)}
    assert (config.task_type, config.task_id) == (task_type, index)


@given(index=st.one_of(st.integers(max_value=-1), st.integers(min_value=2), st.text(max_size=3), st.floats()))
def test_every_bad_index_is_rejected(index):
    text = json.dumps({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": index}})
    with pytest.raises(ValueError, match=r"TF_CONFIG task index .* fix `task.index`"):
        parse_tf_config(text)


def test_empty_object_means_no_cluster():
    assert parse_tf_config("{}").cluster == ClusterSpec({})
    assert not TFConfigClusterResolver.is_present({"TF_CONFIG": " {} "})
    assert TFConfigClusterResolver.is_present({"TF_CONFIG": "{not json"})  # present, so its error shows
    with pytest.raises(ValueError, match="no `cluster`"):
        parse_tf_config("{}", require_task=True)


# --- unknown keys: typos raise with the nearest known key; foreign keys warn or pass -----


@pytest.mark.parametrize(
    "task, key, nearest",
    [
        ({"type": "worker", "id": 1}, "id", "index"),  # used to become index 0, silently
        ({"type": "worker", "idx": 1}, "idx", "index"),
        ({"type": "worker", "task_id": 1}, "task_id", "index"),
        ({"type": "worker", "rank": 1}, "rank", "index"),
        ({"typ": "worker", "index": 1}, "typ", "type"),
        ({"name": "worker", "index": 1}, "name", "type"),
        ({"type": "worker", "index": 1, "indx": 1}, "indx", "index"),
    ],
)
def test_an_unknown_task_key_raises_naming_the_nearest_known_key(task, key, nearest):
    with pytest.raises(ValueError) as info:
        parse_tf_config(_config(task), require_task=True)
    message = str(info.value)
    assert f"unknown key {key!r}; did you mean `{nearest}`?" in message, message
    assert f"`task.{key}`" in message and repr(task) in message


@pytest.mark.parametrize("key, nearest", [("rpclayer", "rpc_layer"), ("clustr", "cluster"), ("tasks", "task"),
                                          ("enviroment", "environment")])
def test_a_misspelled_top_level_key_raises_naming_the_nearest_known_key(key, nearest):
    with pytest.raises(ValueError, match=f"TF_CONFIG has an unknown key '{key}'; did you mean `{nearest}`?"):
        parse_tf_config(_config({"type": "worker", "index": 1}, **{key: "tcp"}))


def test_a_foreign_top_level_key_warns_and_is_ignored():
    with pytest.warns(UserWarning,
                      match="TF_CONFIG has an unknown key 'scheduler_hints', which unison ignores") as record:
        config = parse_tf_config(_config({"type": "worker", "index": 1}, scheduler_hints={"a": 1}))
    assert (config.task_type, config.task_id) == ("worker", 1)
    assert record[0].filename == __file__  # stacklevel points at the caller


def test_keys_that_cloud_schedulers_add_are_accepted_silently(recwarn):
    """AI Platform / Vertex AI add `job` at the top and `trial`/`cloud` in `task`."""
    text = _config({"type": "worker", "index": 1, "trial": "3", "cloud": "c"}, job={"args": []}, environment="cloud")
    config = parse_tf_config(text, require_task=True)
    assert (config.task_type, config.task_id, config.environment) == ("worker", 1, "cloud")
    assert not [w for w in recwarn if "TF_CONFIG" in str(w.message)]
