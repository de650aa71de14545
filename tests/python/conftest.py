"""Fixtures shared by the Python tests. `family`: the engine tests' model family (tests/python/vllm_family.py: two
tiny models, their captures and a fitted mapper), made once per build (vllm_engine.family_cache) with the capture
environment's python (CROSSKV_CAPTURE_PYTHON) and crosskv-fit (CROSSKV_FIT), and copied for each test file into
CROSSKV_TEST_WORK/<module>, where its engines run. tests/python/vllm.sh sets all three."""
import importlib
import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    """CROSSKV_TEST_IMPORTS (set by the ctest wrappers, pytest_in.sh and vllm.sh): the modules the tests need, imported
    here in the tests' own process; one that does not import ends the run as SKIPPED (exit 77) with the reason. With
    CROSSKV_TEST_PRELOAD=1 (vllm.sh, for tests whose engines fork from vllm_engine.Preloaded) vLLM and the
    connector are imported in that process, not here (about 20 s each); one that does not import skips the run alike."""
    for name in filter(None, (m.strip() for m in os.environ.get("CROSSKV_TEST_IMPORTS", "").split(","))):
        try:
            importlib.import_module(name)
        except Exception as e:
            setup = os.environ.get("CROSSKV_TEST_SETUP", "its setup script")
            pytest.exit(f"SKIPPED: {sys.executable} cannot import {name} ({setup}): {type(e).__name__}: {e}",
                        returncode=77)
    if os.environ.get("CROSSKV_TEST_PRELOAD") == "1":  # vLLM imported once, in the engines' preloaded process only
        from vllm_engine import EngineImportError, Preloaded

        try:
            Preloaded.get()
        except EngineImportError as e:
            setup = os.environ.get("CROSSKV_TEST_SETUP", "its setup script")
            pytest.exit(f"SKIPPED: {sys.executable} cannot import {e} ({setup})", returncode=77)


@pytest.fixture(scope="module")
def family(request):
    """The family in CROSSKV_TEST_WORK/<test module>: each test file's engines, stores and logs in a folder of its own
    (one pytest session may run several files: tests/python/vllm.sh)."""
    missing = [v for v in ("CROSSKV_TEST_WORK", "CROSSKV_CAPTURE_PYTHON", "CROSSKV_FIT") if not os.environ.get(v)]
    if missing:
        pytest.skip(f"the engine tests' family needs {', '.join(missing)} (tests/python/vllm.sh sets them)")
    from vllm_engine import make_family

    work = make_family(os.path.join(os.environ["CROSSKV_TEST_WORK"], request.module.__name__.rpartition(".")[2]),
                       os.environ["CROSSKV_CAPTURE_PYTHON"], os.environ["CROSSKV_FIT"])
    return SimpleNamespace(work=work, mapper="out/kall", capture_py=os.environ["CROSSKV_CAPTURE_PYTHON"],
                           fit=os.environ["CROSSKV_FIT"])

