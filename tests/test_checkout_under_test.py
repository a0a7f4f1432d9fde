"""Every process the tests launch runs the code of the checkout the tests run from.

An `mpiexec`'d script's sys.path starts at the script's folder, so without help it imports
whichever h2jax is installed -- an editable install may point at another clone, and a bug
planted in this tree would then pass every MPI test. The launch helpers put this checkout
first on PYTHONPATH (tests/conftest.py: checkout_env); these tests prove it where it matters,
in the launched processes, by the one marker only this checkout has: its own path.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, checkout_env
from tests.test_mpi_transport import MPIEXEC, mpiexec

MINE = str(REPO_ROOT / "h2jax" / "__init__.py")


@pytest.mark.mpi
def test_every_mpi_rank_imports_this_checkout():
    proc, _ = mpiexec(2, "which_h2jax.py", timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("WHICH "))
    assert json.loads(line[len("WHICH "):]) == [MINE, MINE]


@pytest.mark.mpi
def test_a_process_launched_from_another_directory_imports_this_checkout(tmp_path):
    """Not only scripts: `mpiexec python -m h2jax ...` starts elsewhere too (cwd is not the tree)."""
    if not Path(MPIEXEC).exists():
        pytest.skip("mpiexec not found (pip install mpich)")
    code = "import h2jax; print('WHICH', h2jax.__file__)"
    proc = subprocess.run([MPIEXEC, "-n", "1", sys.executable, "-c", code], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env=checkout_env(dict(os.environ)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["WHICH", MINE]


def test_checkout_env_puts_this_checkout_first():
    env = checkout_env({"PYTHONPATH": "/elsewhere", "X": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/elsewhere"] and env["X"] == "1"
    assert checkout_env({})["PYTHONPATH"] == str(REPO_ROOT)
