"""Pipeline parallelism over one mesh axis (``sk.pipeline``) and its schedule tables
(``sk.pipeline_schedule``).

Modules: ``api`` (the public ``pipeline``: argument checks, data axes, dispatch),
``schedules`` (numpy tables, no JAX; their op orders and lockstep runs in ``simulate``, the
op codes in ``ops``), ``stage`` (what every executor shares), ``forward``
(GPipe / circular, autodiff backward), ``explicit`` (the table-driven explicit backward:
1F1B, interleaved 1F1B, ZB-H1, ZB-V), ``split`` (ZB's B/W without recompute), ``order``
(stage-major layer storage).
"""

from .api import pipeline as pipeline
from .keep import LEAN_RESIDUALS as LEAN_RESIDUALS
from .keep import lean_policy as lean_policy
from .order import pipeline_layer_order as pipeline_layer_order
from .order import pipeline_layers_natural as pipeline_layers_natural
from .order import pipeline_layers_stage_major as pipeline_layers_stage_major
from .schedules import SCHEDULES as SCHEDULES
from .schedules import Schedule as Schedule
from .schedules import pipeline_schedule as pipeline_schedule
