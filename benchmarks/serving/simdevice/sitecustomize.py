"""On PYTHONPATH only for gpu_serving.py `--sim-step-ms` runs: every process that then imports
pdserve's engine runs it on benchmarks/serving/sim_device.py's simulated device."""

import importlib.abc
import importlib.util
import os
import sys

_STEP_MS = os.environ.get("PDSERVE_BENCH_SIM_STEP_MS")
_HERE = os.path.dirname(os.path.abspath(__file__))  # <repo>/benchmarks/serving/simdevice
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))


class _AfterEngineImport(importlib.abc.MetaPathFinder):
    """Runs `install` right after pdserve.engine.engine is first imported."""

    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name != "pdserve.engine.engine":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.loader is not None
        exec_module = spec.loader.exec_module

        def exec_then_install(module):  # type: ignore[no-untyped-def]
            exec_module(module)
            sys.modules[name] = module
            if _ROOT not in sys.path:
                sys.path.append(_ROOT)
            from benchmarks.serving.sim_device import install

            install(float(_STEP_MS), float(os.environ.get("PDSERVE_BENCH_SIM_HOST_US") or 0))

        spec.loader.exec_module = exec_then_install  # type: ignore[method-assign]
        return spec


if _STEP_MS:
    sys.meta_path.insert(0, _AfterEngineImport())
