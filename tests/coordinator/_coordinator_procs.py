"""Starting and always ending the subprocesses of coordinator tests."""

import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def alive(pid):
    """Whether ``pid`` is a running (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except FileNotFoundError:
        return False


class Processes:
    """Subprocesses started in their own sessions; ``close`` kills whatever is left."""

    def __init__(self):
        self.started = []

    def python(self, script, env=None, args=()):
        """Runs a Python script file in a subprocess, with the tests' helpers importable."""
        full_env = dict(os.environ if env is None else env)
        full_env["PYTHONPATH"] = os.pathsep.join([str(HERE), full_env.get("PYTHONPATH", "")])
        process = subprocess.Popen(
            [sys.executable, str(script), *args],
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.started.append(process)
        return process

    def close(self):
        for process in self.started:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
            if process.stdout:
                process.stdout.close()
