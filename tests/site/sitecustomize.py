"""Imported at start-up by every Python process the tests start (``tests/conftest.py`` puts this
folder on their ``PYTHONPATH``): the process's objects are frozen for the collector as it exits.

A process that imported torch spends about 0.9 s of CPU at exit (Lightning's, 2.5 s) in the
collector's last passes over torch's millions of objects; the ~200 processes of the suite
(torchrun's ranks and launchers, Lightning's, notebook kernels, killed builders) spent minutes
of the CI's two cores on it. Only cyclic garbage left at exit goes uncollected: ``atexit``
handlers (this one is registered first, so it runs last), ``weakref.finalize`` and reference
counting behave as in any process. A ``sitecustomize`` later on the path is run as well.
"""

import atexit
import gc
import importlib.machinery
import importlib.util
import os
import sys

if not getattr(sys, "_gpuload_tests_site", False):  # once, though a copy of this folder be on the path too
    sys._gpuload_tests_site = True
    atexit.register(gc.freeze)
    _here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "sitecustomize", [p for p in sys.path if os.path.realpath(p or os.curdir) != _here])
    if _spec is not None and _spec.loader is not None:
        _next = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(_next)
