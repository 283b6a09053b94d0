"""docs/from-tensorflow.md: every unison code block runs, and every unison name it mentions exists.

Each ```python fence in the guide is preceded by a marker comment:

* ``<!-- tf -->``: TensorFlow code, shown for comparison and not run;
* ``<!-- run: inprocess NAME [after=OTHER] -->``: executed here in a fresh namespace
  (after OTHER's block, in the same namespace, when it continues that example);
* ``<!-- run: launch NAME ARGS... -->``: written to a file and run as
  ``python -m unison.launch ARGS... FILE`` in a temporary directory.

Every run block has a check below, keyed by NAME, that looks at what it produced (not
only that it did not raise); a block without a check, a check without a block, or a
python block without a marker fails ``test_every_python_block_is_marked_and_checked``,
so no block can be skipped silently.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import unison

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "from-tensorflow.md"

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*(?:(?P<tf>tf)|run:\s*(?P<mode>inprocess|launch)\s+(?P<name>\w+)(?P<rest>.*?))\s*-->$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of the guide and the marker line above it."""

    lang: str
    marker: str
    code: str
    line: int  # 1-based line of the opening fence

    @property
    def parsed(self) -> re.Match[str] | None:
        return _MARKER.match(self.marker)

    @property
    def mode(self) -> str | None:
        m = self.parsed
        return None if m is None else ("tf" if m["tf"] else m["mode"])

    @property
    def name(self) -> str:
        return self.parsed["name"]  # type: ignore[index]

    @property
    def args(self) -> list[str]:
        return (self.parsed["rest"] or "").split()  # type: ignore[index]

    @property
    def after(self) -> str | None:
        found = [a.removeprefix("after=") for a in self.args if a.startswith("after=")]
        return found[0] if found else None


def parse_guide(text: str) -> tuple[list[Block], str]:
    """The guide's fenced blocks, and its text outside them (prose and tables)."""
    lines = text.splitlines()
    blocks, prose, i = [], [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            prose.append(lines[i])
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"the fence opened at line {i + 1} of {GUIDE.name} is never closed"
        before = [line for line in lines[:i] if line.strip()]
        marker = before[-1].strip() if before else ""
        blocks.append(Block(opening[1], marker, "\n".join(lines[i + 1 : end]) + "\n", i + 1))
        i = end + 1
    return blocks, "\n".join(prose)


BLOCKS, PROSE = parse_guide(GUIDE.read_text())
RUN_BLOCKS = {b.name: b for b in BLOCKS if b.mode in ("inprocess", "launch")}
INPROCESS = sorted(name for name, b in RUN_BLOCKS.items() if b.mode == "inprocess")
LAUNCHED = sorted(name for name, b in RUN_BLOCKS.items() if b.mode == "launch")


# -- the guide's structure ------------------------------------------------------------------


def test_every_python_block_is_marked_and_checked():
    python = [b for b in BLOCKS if b.lang == "python"]
    unmarked = [b.line for b in python if b.mode is None]
    assert not unmarked, f"python blocks at lines {unmarked} need a <!-- tf --> or <!-- run: ... --> marker"
    names = [b.name for b in python if b.mode != "tf"]
    assert len(names) == len(set(names)), f"run blocks share a name: {names}"
    assert set(names) == set(INPROCESS_CHECKS) | set(LAUNCH_CHECKS), (
        f"run blocks {sorted(set(names) - set(INPROCESS_CHECKS) - set(LAUNCH_CHECKS))} have no check, and checks "
        f"{sorted((set(INPROCESS_CHECKS) | set(LAUNCH_CHECKS)) - set(names))} have no block")
    assert set(INPROCESS) == set(INPROCESS_CHECKS) and set(LAUNCHED) == set(LAUNCH_CHECKS)
    for block in RUN_BLOCKS.values():
        assert block.after is None or RUN_BLOCKS[block.after].mode == "inprocess", block
    # the guide's five examples: a TF block beside unison's
    assert sum(b.mode == "tf" for b in BLOCKS) >= 5 and len(RUN_BLOCKS) >= 5


_UNISON_NAME = re.compile(r"(?<![\w.])unison(?:\.[A-Za-z_]\w*)+")
_INSTANCE_NAME = re.compile(r"(?<![\w.])strategy\.extended\.[A-Za-z_]\w*")


def _resolve(dotted: str) -> object:
    """The object ``dotted`` names, importing submodules on the way."""
    parts = dotted.split(".")
    obj: object = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def test_every_unison_name_in_the_guide_exists():
    names = sorted(set(_UNISON_NAME.findall(PROSE)))
    assert len(names) > 100, f"found only {len(names)} unison names: the pattern is stale"
    missing = []
    for name in names:
        try:
            _resolve(name)
        except (AttributeError, ImportError):
            missing.append(name)
    assert not missing, f"docs/from-tensorflow.md names what unison does not have: {missing}"
    strategy = unison.OneDeviceStrategy("cpu:0")
    for name in sorted(set(_INSTANCE_NAME.findall(PROSE))):
        assert hasattr(strategy.extended, name.rsplit(".", 1)[1]), name


def test_the_readme_links_the_guide():
    assert "(docs/from-tensorflow.md)" in (ROOT / "README.md").read_text()


# -- blocks run in this process -------------------------------------------------------------


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    """Replica threads already use the cores; an OpenMP pool in each makes tiny ops crawl."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_inprocess(name: str) -> dict:
    """Executes the block ``name`` (after the blocks it continues) in a fresh namespace."""
    chain, block = [], RUN_BLOCKS[name]
    while True:
        chain.insert(0, block)
        if block.after is None:
            break
        block = RUN_BLOCKS[block.after]
    namespace: dict = {"__name__": f"from_tensorflow_{name}"}
    for block in chain:
        exec(compile(block.code, f"{GUIDE}:{block.line}", "exec"), namespace)
    return namespace


def _epoch_losses(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"epoch \d+: loss (\d+\.\d+)", text)]


def _replicas_equal(strategy, model) -> bool:
    return all(all(torch.equal(c, components[0]) for c in components)
               for components in (strategy.experimental_local_results(p) for p in model.parameters()))


def check_mirrored(ns: dict, out: str) -> None:
    strategy, model = ns["strategy"], ns["model"]
    assert strategy.num_replicas_in_sync == 2 and "replicas: 2" in out
    losses = _epoch_losses(out)
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], out
    assert _replicas_equal(strategy, model)


def check_tf_style_loss(ns: dict, out: str) -> None:
    strategy, model, optimizer = ns["strategy"], ns["model"], ns["optimizer"]
    assert strategy.extended.gradient_reduce_op is unison.ReduceOp.SUM
    assert re.search(r"last batch: loss \d+\.\d+", out), out
    assert _replicas_equal(strategy, model)
    # The guide's claim: a mean loss with averaged gradients and TF's global-batch-scaled
    # loss with summed gradients make the same update (the batch of 32 splits evenly).
    batch = next(iter(ns["dist_dataset"]))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    after = {}
    for op, step in ((unison.ReduceOp.MEAN, ns["train_step"]), (unison.ReduceOp.SUM, ns["train_step_tf_style"])):
        model.load_state_dict(start)
        strategy.extended.gradient_reduce_op = op
        strategy.run(step, args=(batch,))
        assert _replicas_equal(strategy, model)
        after[op] = [t.clone() for t in model.state_dict().values()]
    assert optimizer.defaults["momentum"] == 0  # stateless SGD: the two steps start alike
    moved = max((a - b).abs().max().item() for a, b in zip(after[unison.ReduceOp.MEAN], start.values()))
    assert moved > 1e-3
    diff = max((a - b).abs().max().item() for a, b in zip(after[unison.ReduceOp.MEAN], after[unison.ReduceOp.SUM]))
    assert diff < 1e-6, diff


def check_from_function(ns: dict, out: str) -> None:
    strategy, dist_dataset = ns["strategy"], ns["dist_dataset"]
    assert dist_dataset.input_contexts == (unison.InputContext(1, 0, 2),)
    x, y = next(iter(dist_dataset))
    assert [len(t) for t in strategy.experimental_local_results(x)] == [16, 16]
    assert [len(t) for t in strategy.experimental_local_results(y)] == [16, 16]
    assert re.search(r"last batch: loss \d+\.\d+", out), out
    assert _replicas_equal(strategy, ns["model"])


INPROCESS_CHECKS: dict[str, Callable[[dict, str], None]] = {
    "mirrored": check_mirrored,
    "tf_style_loss": check_tf_style_loss,
    "from_function": check_from_function,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", INPROCESS)
def test_inprocess_block_runs(name, capsys):
    namespace = run_inprocess(name)
    INPROCESS_CHECKS[name](namespace, capsys.readouterr().out)


# -- blocks run under `unison launch` -------------------------------------------------------


def check_multi_worker(out: str, workdir: Path) -> None:
    assert "[worker:0] worker:0, 2 replicas" in out and "[worker:1] worker:1, 2 replicas" in out, out
    losses = _epoch_losses(out)
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], out  # printed by the chief only
    assert "[worker:1] epoch" not in out
    saved = torch.load(workdir / "checkpoints" / "model.pt")
    assert set(saved) == {"model", "optimizer"} and saved["model"]["0.weight"].shape == (16, 10)


def check_parameter_server(out: str, workdir: Path) -> None:
    assert "[chief:0] embedding shards on ['/job:ps/replica:0/task:0', '/job:ps/replica:0/task:1']" in out, out
    first, last = map(float, re.search(r"\[chief:0\] loss (\d+\.\d+) -> (\d+\.\d+)", out).groups())
    assert last < first, out


def check_backup(out: str, workdir: Path) -> None:
    assert "worker:1 exited with code 137" in out and "restarting the cluster" in out, out
    assert "[worker:0] resumed from the backup: epoch 0, step 8" in out, out  # the last backup before the crash
    assert re.search(r"\[worker:0\] trained 24 steps; loss \d+\.\d+", out), out
    assert not (workdir / "backup").exists()  # deleted when training finished


LAUNCH_CHECKS: dict[str, Callable[[str, Path], None]] = {
    "multi_worker": check_multi_worker,
    "parameter_server": check_parameter_server,
    "backup": check_backup,
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", LAUNCHED)
def test_launched_block_runs(name, tmp_path):
    block = RUN_BLOCKS[name]
    script = tmp_path / "train.py"
    script.write_text(block.code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("TF_CONFIG", None)
    done = subprocess.run(
        [sys.executable, "-m", "unison.launch", *block.args, str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    LAUNCH_CHECKS[name](out, tmp_path)
