"""ResNet recipe: ResNet-18/50 in Flax NNX with global-batch BatchNorm under DP and ZeRO."""

from .config import Config as Config
from .data import DataError as DataError
from .model import ResNet as ResNet
from .train import Evaluator as Evaluator
from .train import loss_fn as loss_fn
from .train import make_optimizer as make_optimizer
from .train import make_plan as make_plan
from .train import make_step as make_step
