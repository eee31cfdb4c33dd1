"""Observe: what the loader and the training loop spent their time on, and why.

* :mod:`~gpuload.observe.metrics`: per-stage spans and the training thread's waits;
* :mod:`~gpuload.observe.trace`: the events kept, as a Chrome trace for Perfetto;
* :mod:`~gpuload.observe.stats`: the summary of what was recorded (:class:`~gpuload.Stats`);
* :mod:`~gpuload.observe.sampling`: CPU and GPU utilisation on a background thread;
* :mod:`~gpuload.observe.watch`: :func:`gpuload.watch`, any loader timed from the training side;
* :mod:`~gpuload.observe.diagnose`: :func:`gpuload.diagnose`, what limits a loop and what to do.

``gpuload profile``, which runs a dataset under a step and reports, is an application on
top of these (:mod:`gpuload.tools.profile`).
"""

from ..lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__, __path__)  # ``gpuload.observe.X`` imported on first use
