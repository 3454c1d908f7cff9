"""GPT-style decoder recipe: ``python -m models.transformer --help``.

``config`` (shapes), ``model`` (the NNX decoder), ``data`` (byte-level stdlib corpus and
token files), ``layouts`` (the logical-axis → mesh-axis table), ``train`` (the entry point).
"""

from .config import SIZES as SIZES
from .config import Config as Config
from .model import PipelineSpec as PipelineSpec
from .model import Transformer as Transformer
from .model import flops_per_token as flops_per_token
from .model import loss_fn as loss_fn
from .model import param_count as param_count
