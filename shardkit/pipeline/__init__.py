"""Pipeline parallelism over one mesh axis (``sk.pipeline``) and its schedule tables.

Modules: ``api`` (the public ``pipeline``: argument checks, data axes, dispatch),
``schedules`` (numpy tables, no JAX), ``stage`` (what every executor shares), ``forward``
(GPipe / circular, autodiff backward), ``explicit`` (table-driven explicit backward: 1F1B).
"""

from .api import SCHEDULES as SCHEDULES
from .api import pipeline as pipeline
