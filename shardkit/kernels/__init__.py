"""The fused forms the target runs, each with a plain-JAX form that is the CPU path and the
reference it is tested against: flash attention (``attention``)."""

from .attention import IMPLEMENTATIONS as IMPLEMENTATIONS
from .attention import KernelFallbackWarning as KernelFallbackWarning
from .attention import attention as attention
from .attention import attention_implementation as attention_implementation
from .blockwise import blockwise_attention as blockwise_attention
from .blockwise import reference_attention as reference_attention
