"""shardkit: declare a mesh and per-layer partition specs; get a compiled SPMD train step."""

from . import _quiet as _quiet  # first: imports JAX without the CUDA plugin's start-up chatter
from . import cost as cost
from . import distributed as distributed
from . import fp8 as fp8
from . import kernels as kernels
from . import offload as offload
from . import viz as viz
from .context import context_attention as context_attention
from .context import context_shard as context_shard
from .context import context_unshard as context_unshard
from .diloco import DiLoCo as DiLoCo
from .cost import search as search
from .explain import Collective as Collective
from .explain import Report as Report
from .jit import jit as jit
from .kernels import attention as attention
from .kernels import chunked_cross_entropy as chunked_cross_entropy
from .mesh import describe_mesh as describe_mesh
from .mesh import make_mesh as make_mesh
from .mesh import parse_mesh_spec as parse_mesh_spec
from .mesh import use_cpu_devices as use_cpu_devices
from .moe import moe as moe
from .moe import RaggedFallbackWarning as RaggedFallbackWarning
from .pipeline import pipeline as pipeline
from .pipeline import LEAN_RESIDUALS as LEAN_RESIDUALS
from .pipeline import lean_policy as lean_policy
from .pipeline import pipeline_schedule as pipeline_schedule
from .pipeline import pipeline_layer_order as pipeline_layer_order
from .pipeline import pipeline_layers_natural as pipeline_layers_natural
from .pipeline import pipeline_layers_stage_major as pipeline_layers_stage_major
from .plan import Plan as Plan
from .plan import active_plan as active_plan
from .plan import constrain as constrain
from .prefetch import Prefetch as Prefetch
from .prefetch import prefetch as prefetch
from .precision import Precision as Precision
from .rules import AxisRules as AxisRules
from .rules import LeafLayout as LeafLayout
from .rules import PathRules as PathRules
from .rules import ShardingError as ShardingError
from .step import NonFiniteError as NonFiniteError
from .step import TrainState as TrainState
from .step import TrainStep as TrainStep
from .step import train_step as train_step
from .xla import target_platform as target_platform
from .xla import xla_flags as xla_flags

__version__ = "0.1.0"


def __getattr__(name: str):
    # Orbax (the checkpoint package) takes seconds to import: a process that never saves or
    # restores — the deviceless compile children, `shardkit mesh`, `--help` — does not pay them.
    if name in ("checkpoint", "Checkpointer"):
        import importlib

        checkpoint = importlib.import_module(".checkpoint", __name__)
        return checkpoint if name == "checkpoint" else checkpoint.Checkpointer
    raise AttributeError(f"module 'shardkit' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), "checkpoint", "Checkpointer"])
