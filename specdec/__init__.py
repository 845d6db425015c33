"""specdec: speculative decoding with token trees for HuggingFace causal LMs.

``SpecDecoder`` / ``wrap`` run the loop (draft -> tree forward -> verify -> commit);
``TokenTree`` is what drafters return; ``verify_greedy`` / ``verify_stochastic`` decide what is
accepted; ``KVCache`` holds the static-shape KV; ``specdec.hf`` plugs into transformers'
``AttentionInterface``. Importing has no side effects (registration happens in ``hf.prepare_model``).
"""

from specdec.engine import GenerationOutput, SpecDecoder, SpeculativeModel, StepStats, wrap
from specdec.kv import KVCache
from specdec.sampling import SamplingConfig, logits_to_probs, warp_logits
from specdec.tree import PROPOSALS, TokenTree
from specdec.verify import Verdict, verify_greedy, verify_stochastic, verify_stochastic_batch

__all__ = [
    "GenerationOutput",
    "KVCache",
    "PROPOSALS",
    "SamplingConfig",
    "SpecDecoder",
    "SpeculativeModel",
    "StepStats",
    "TokenTree",
    "Verdict",
    "logits_to_probs",
    "verify_greedy",
    "verify_stochastic",
    "verify_stochastic_batch",
    "warp_logits",
    "wrap",
]
