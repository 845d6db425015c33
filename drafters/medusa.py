"""Medusa-style heads on the target's last hidden state, and the drafter that turns them into trees.

``MedusaHeads`` holds K heads. Head k (k = 1..K) reads the target's final hidden state ``h_j`` at
position j -- the vector the target's LM head turns into the distribution of token j+1 -- and
predicts token ``j + 1 + k``, i.e. k tokens beyond the target's own next token. Each head is a
residual SiLU block (Medusa's ``ResBlock``: ``z = h + SiLU(W h + b)``) followed by **the target's
own LM head** (frozen, shared by all heads, not stored with the heads).

Why share the LM head: Medusa-1 gives every head its own ``V x H`` projection initialized from the
LM head. For Qwen2.5-Coder-1.5B that is 233M parameters per head (151,936 x 1,536) against 2.4M
for the residual block; sharing keeps the heads tiny (a few MB on disk), makes them cheap to train
and keeps their outputs in the target's token space. ``W`` and ``b`` start at zero, so a fresh head
returns ``h`` unchanged and predicts exactly like the LM head (token j+1): training starts from
the target's own next-token guess instead of from noise.

``MedusaDrafter`` needs the target's hidden state that predicted the root (``needs_hidden_states =
True``, i.e. ``"last"``: the engine passes it as ``DraftContext.hidden[-1]``, taken from the
verification forward of the previous step or from the prefill). It fills a static topology
(``drafters.trees``): node ``(r_1, ..., r_d)`` gets head d's rank-``r_d`` token. Children are
deterministic (``"topk"``), so stochastic verification stays lossless without ``draft_probs``.

Heads are saved as ``medusa_heads.safetensors`` next to ``medusa_config.json`` (sizes, the target
it was trained for, training notes); ``training.medusa`` trains them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from drafters._build import root_only
from specdec.drafting import BaseDrafter, DraftContext
from drafters.trees import AcceptanceTable, Topology, static_tree, truncate_choices, validate_choices
from specdec.tree import TokenTree

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "MedusaDrafter", "MedusaHeads", "ResBlock"]

CONFIG_NAME = "medusa_config.json"
WEIGHTS_NAME = "medusa_heads.safetensors"


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)`` with ``W``, ``b`` zero-initialized (identity at start)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads (each ``num_layers`` residual blocks) that share the target's LM head.

    Args:
        hidden_size: the target's hidden size H.
        num_heads: K; head k predicts the token k positions after the target's next token.
        num_layers: residual blocks per head.

    ``forward(hidden, lm_head)``: ``hidden`` float ``[..., H]`` (any dtype; computed in the heads'
    dtype), ``lm_head`` the target's output embedding; returns logits ``[..., K, V]`` in the LM
    head's dtype.
    """

    def __init__(self, hidden_size: int, num_heads: int = 4, num_layers: int = 1) -> None:
        super().__init__()
        for name, val in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_layers", num_layers)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {val!r}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers))) for _ in range(num_heads)
        )

    def head_features(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Head k's (0-based) features ``[..., H]`` in the heads' dtype."""
        w = self.blocks[k][0].linear.weight
        return self.blocks[k](hidden.to(w.dtype))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """All heads' features ``[..., K, H]`` (the LM head's inputs)."""
        return torch.stack([self.head_features(hidden, k) for k in range(self.num_heads)], dim=-2)

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        feats = self.features(hidden)
        return lm_head(feats.to(lm_head.weight.dtype))

    def config(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden_size, "num_heads": self.num_heads, "num_layers": self.num_layers}

    def save(self, out_dir: str | os.PathLike[str], **meta: Any) -> Path:
        """Write ``medusa_heads.safetensors`` (float32) and ``medusa_config.json`` (+ ``meta``) to ``out_dir``."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        (out / CONFIG_NAME).write_text(json.dumps({**self.config(), **meta}, indent=2, sort_keys=True) + "\n")
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str], device: torch.device | str | None = None,
             dtype: torch.dtype | None = None) -> "MedusaHeads":
        """Load heads saved by :meth:`save` (``path``: the directory)."""
        from safetensors.torch import load_file

        p = Path(path)
        cfg_file, weights = p / CONFIG_NAME, p / WEIGHTS_NAME
        if not cfg_file.is_file() or not weights.is_file():
            raise ValueError(f"path: expected a directory with {CONFIG_NAME} and {WEIGHTS_NAME}, got {str(p)!r}")
        cfg = json.loads(cfg_file.read_text())
        heads = cls(int(cfg["hidden_size"]), int(cfg["num_heads"]), int(cfg.get("num_layers", 1)))
        heads.load_state_dict(load_file(str(weights)))
        heads.meta = cfg
        return heads.to(device=device, dtype=dtype).eval()


def heads_table(heads: MedusaHeads) -> AcceptanceTable | None:
    """The held-out rank rates saved with ``heads`` as an ``AcceptanceTable`` (None if absent)."""
    rates = getattr(heads, "meta", {}).get("heldout_rank_rates")
    if not rates:
        return None
    if len(rates) != heads.num_heads or any(not row or any(not 0.0 <= x <= 1.0 for x in row) for row in rates):
        raise ValueError(f"heads: expected heldout_rank_rates of {heads.num_heads} rows of rates in [0, 1], got {rates!r}")
    return AcceptanceTable(tuple(tuple(float(x) for x in row) for row in rates))


class MedusaDrafter(BaseDrafter):
    """Fills a static topology with Medusa head predictions.

    Args:
        target: the target causal LM (its output embedding is the heads' LM head).
        heads: trained ``MedusaHeads`` (moved to the target's LM-head device).
        choices: a fixed topology (rank paths; truncated to the step's budget in the given order,
            so pass choices in build order), or None: a tree grown for the engine's budget by
            ``drafters.trees.static_tree`` (built once per size) from ``table``.
        table: the acceptance estimates the trees are grown from (ignored with ``choices``): an
            ``AcceptanceTable`` (e.g. from recorded acceptance), or None: the heads' own held-out
            rank rates when they were saved with them (``specdec train-medusa`` does,
            ``heldout_rank_rates`` in ``medusa_config.json``), else the default prior; ``"prior"``
            forces the default prior.
    """

    needs_hidden_states = True

    def __init__(self, target, heads: MedusaHeads, choices=None, table=None) -> None:
        lm_head = target.get_output_embeddings()
        if lm_head is None or getattr(lm_head, "weight", None) is None:
            raise ValueError(f"target: expected a causal LM with an output embedding, got {type(target).__name__}")
        if not isinstance(heads, MedusaHeads):
            raise ValueError(f"heads: expected a drafters.medusa.MedusaHeads, got {type(heads).__name__}")
        hidden = lm_head.weight.shape[1]
        if heads.hidden_size != hidden:
            raise ValueError(f"heads: expected hidden_size {hidden} (the target's), got {heads.hidden_size}")
        self.lm_head = lm_head
        self.heads = heads.to(lm_head.weight.device).eval()
        self.vocab_size = int(lm_head.weight.shape[0])
        self.choices = None if choices is None else validate_choices(choices)
        if self.choices is not None and max(len(c) for c in self.choices) > heads.num_heads:
            raise ValueError(f"choices: expected depth <= num_heads = {heads.num_heads}, got "
                             f"{max(len(c) for c in self.choices)}")  # fmt: skip
        if isinstance(table, str):
            if table != "prior":
                raise ValueError(f"table: expected an AcceptanceTable, None or 'prior', got {table!r}")
            table = None
        elif table is None:
            table = heads_table(heads)
        elif not isinstance(table, AcceptanceTable):
            raise ValueError(f"table: expected an AcceptanceTable, None or 'prior', got {type(table).__name__}")
        if table is not None and table.depth > heads.num_heads:
            raise ValueError(f"table: expected depth <= num_heads = {heads.num_heads}, got {table.depth}")
        self.table = table
        self._topologies: dict[int, tuple[Topology, torch.Tensor, torch.Tensor]] = {}

    def topology(self, budget: int) -> Topology:
        return self._layout(budget)[0]

    def _layout(self, budget: int):
        if budget not in self._topologies:
            if self.choices is not None:
                ch = truncate_choices(self.choices, budget)
            elif self.table is not None:
                ch = static_tree(budget, self.table)
            else:
                ch = static_tree(budget, depth=self.heads.num_heads)
            topo = Topology.from_choices(ch)
            dev = self.lm_head.weight.device
            self._topologies[budget] = (topo, (topo.depth[1:] - 1).to(dev), topo.rank[1:].to(dev))
        return self._topologies[budget]

    @torch.no_grad()
    def propose(self, context: DraftContext) -> TokenTree:
        return self.propose_batch([context])[0]

    @torch.no_grad()
    def propose_batch(self, contexts: Sequence[DraftContext]) -> list[TokenTree]:
        """The trees of ``contexts`` (``propose`` is a batch of one): root-only without a feature or a
        budget, else the static topology of the budget filled from the heads, with one heads
        forward, one top-k and one device-to-host copy per budget for all its contexts."""
        trees: list[TokenTree | None] = [None] * len(contexts)
        groups: dict[int, list[int]] = {}
        for i, c in enumerate(contexts):
            if c.hidden is None or c.tree_size <= 0 or self._layout(c.tree_size)[0].n == 1:
                trees[i] = root_only(int(c.tokens[-1]))
            else:
                groups.setdefault(c.tree_size, []).append(i)
        for budget, idx in groups.items():
            topo, depth_idx, rank_idx = self._layout(budget)
            for i, tree in zip(idx, self._fill([contexts[i] for i in idx], topo, depth_idx, rank_idx)):
                trees[i] = tree
        return trees  # type: ignore[return-value] -- every slot filled above

    def _fill(self, contexts: Sequence[DraftContext], topo: Topology, depth_idx: torch.Tensor,
              rank_idx: torch.Tensor) -> list[TokenTree]:
        """Fill ``topo`` for each context from the heads on its root-predicting feature (one batch)."""
        dev = self.lm_head.weight.device
        feature = torch.stack([c.hidden[-1].to(dev) for c in contexts])  # [B, H]: the rows that predicted the roots
        logits = self.heads(feature, self.lm_head)  # [B, K, V]
        top = torch.topk(logits, topo.max_rank + 1, dim=-1).indices  # [B, K, R]
        nodes = top[:, depth_idx, rank_idx].to(torch.int64).cpu()  # [B, n - 1]
        roots = torch.tensor([int(c.tokens[-1]) for c in contexts], dtype=torch.int64)
        return [TokenTree(torch.cat([roots[b : b + 1], nodes[b]]), topo.parents.clone()) for b in range(len(contexts))]
