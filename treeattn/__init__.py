"""Tree attention: token-tree mask layout, Triton kernel, pure-torch references, benchmark.

Does not import transformers or anything from specdec / drafters.
"""

from treeattn.cascade import CascadeConfig, cascade_tree_attention
from treeattn.layout import BITS_PER_WORD, TreeMask, num_words
from treeattn.ops import KernelConfig, tree_attention

__all__ = ["BITS_PER_WORD", "CascadeConfig", "KernelConfig", "TreeMask", "cascade_tree_attention", "num_words",
           "tree_attention"]
