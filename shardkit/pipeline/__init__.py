"""Pipeline parallelism over one mesh axis (``sk.pipeline``) and its schedule tables
(``sk.pipeline_schedule``).

Modules: ``api`` (the public ``pipeline``: argument checks, data axes, dispatch),
``schedules`` (numpy tables, no JAX), ``stage`` (what every executor shares), ``forward``
(GPipe / circular, autodiff backward), ``explicit`` (the table-driven explicit backward:
1F1B, interleaved 1F1B, ZB-H1).
"""

from .api import pipeline as pipeline
from .schedules import SCHEDULES as SCHEDULES
from .schedules import Schedule as Schedule
from .schedules import pipeline_schedule as pipeline_schedule
