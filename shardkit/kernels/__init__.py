"""The fused forms the target runs, each with a plain-JAX form that is the CPU path and the
reference it is tested against: flash attention (``attention``), the output projection +
cross-entropy in token chunks (``chunked_cross_entropy``), the grouped matmul of dropless MoE
(``grouped_matmul``, ``lax.ragged_dot`` its reference)."""

from .attention import IMPLEMENTATIONS as IMPLEMENTATIONS
from .attention import KernelFallbackWarning as KernelFallbackWarning
from .attention import attention as attention
from .attention import attention_implementation as attention_implementation
from .blockwise import blockwise_attention as blockwise_attention
from .blockwise import reference_attention as reference_attention
from .grouped import grouped_matmul as grouped_matmul
from .loss import chunked_cross_entropy as chunked_cross_entropy
from .loss import cross_entropy as cross_entropy
from .loss import reference_cross_entropy as reference_cross_entropy
