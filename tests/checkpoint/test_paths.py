"""Write paths of chief and workers (TF's distributed_file_utils)."""

from __future__ import annotations

import os

import unison
from unison import remove_temp_dir_with_filepath, remove_temp_dirpath, write_dirpath, write_filepath


def _worker(task_type: str, task_id: int) -> unison.MultiWorkerMirroredStrategy:
    spec = unison.ClusterSpec({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})
    return unison.MultiWorkerMirroredStrategy(unison.SimpleClusterResolver(spec, task_type=task_type, task_id=task_id))


def test_the_chief_writes_the_real_paths_and_removes_nothing(tmp_path):
    chief = _worker("chief", 0)
    assert write_dirpath(tmp_path, chief) == str(tmp_path)
    assert write_filepath(tmp_path / "ckpt" / "model.pt", chief) == str(tmp_path / "ckpt" / "model.pt")
    (tmp_path / "keep.pt").write_text("x")
    remove_temp_dirpath(tmp_path, chief)
    remove_temp_dir_with_filepath(tmp_path / "keep.pt", chief)
    assert (tmp_path / "keep.pt").exists()


def test_other_workers_write_into_their_own_temporary_directory_and_remove_it(tmp_path):
    worker = _worker("worker", 1)
    directory = write_dirpath(tmp_path, worker)
    assert directory == str(tmp_path / "workertemp_1") and os.path.isdir(directory)
    path = write_filepath(tmp_path / "model.pt", worker)
    assert path == str(tmp_path / "workertemp_1" / "model.pt")
    with open(path, "w") as f:
        f.write("temporary")
    remove_temp_dir_with_filepath(tmp_path / "model.pt", worker)
    assert not (tmp_path / "workertemp_1").exists()
    write_dirpath(tmp_path, worker)
    remove_temp_dirpath(tmp_path, worker)
    assert os.listdir(tmp_path) == []


def test_local_strategies_and_no_strategy_are_the_chief(tmp_path):
    assert write_filepath(tmp_path / "m.pt", None) == str(tmp_path / "m.pt")
    assert write_filepath(tmp_path / "m.pt", unison.MirroredStrategy(["cpu:0", "cpu:1"])) == str(tmp_path / "m.pt")


def test_the_returned_file_path_removes_the_workers_temporary_directory(tmp_path):
    worker = _worker("worker", 1)
    for given in ("original", "returned"):
        path = write_filepath(tmp_path / "ckpt" / "model.pt", worker)
        with open(path, "w") as f:
            f.write("temporary")
        remove_temp_dir_with_filepath(tmp_path / "ckpt" / "model.pt" if given == "original" else path, worker)
        assert os.listdir(tmp_path / "ckpt") == [], given


def test_the_returned_directory_removes_itself_and_is_not_nested_again(tmp_path):
    worker = _worker("worker", 1)
    directory = write_dirpath(tmp_path, worker)
    assert write_dirpath(directory, worker) == directory  # TF's _get_temp_dir: no workertemp_1/workertemp_1
    assert write_filepath(os.path.join(directory, "m.pt"), worker) == os.path.join(directory, "m.pt")
    (tmp_path / "workertemp_1" / "sub").mkdir()
    remove_temp_dirpath(directory + os.sep, worker)
    assert os.listdir(tmp_path) == []
    # Another task's directory is not this worker's: it gets its own inside, as in TensorFlow.
    assert write_dirpath(tmp_path / "workertemp_2", worker) == str(tmp_path / "workertemp_2" / "workertemp_1")


def test_the_chief_removes_nothing_given_the_returned_paths(tmp_path):
    chief = _worker("chief", 0)
    path = write_filepath(tmp_path / "model.pt", chief)
    with open(path, "w") as f:
        f.write("kept")
    remove_temp_dir_with_filepath(path, chief)
    remove_temp_dirpath(write_dirpath(tmp_path, chief), chief)
    assert os.listdir(tmp_path) == ["model.pt"]
