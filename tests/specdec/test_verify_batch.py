"""The one-copy stochastic verifier (``verify_stochastic_batch``): lossless on random tree shapes,
batched and with warped targets, and one device-to-host copy per call.

Setting: a Markov "target" on a 5-token vocabulary (node i's target row is ``P[tokens[i]]``, the
rows warped by a ``SamplingConfig``) and a Markov draft ``Q`` that proposes each node's children
as the tree's proposal kind says. Shapes are random (sizes 1..19, branching up to 4: sizes that
divide no block size), four trees per call, padding rows NaN (they must be ignored). As in
``test_verify``, the first two emitted tokens (a continuation tree when a step emits one) must
follow ``P[root, x] P[x, y]``: chi-square at alpha = 1e-4, fixed seeds.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import specdec
from specdec import SamplingConfig, TokenTree, logits_to_probs, verify_stochastic, verify_stochastic_batch
from tests.specdec.helpers import chi2_fails

V = 5
MAX_KIDS = 4
BATCH = 4
SAMPLES = 3000


def _markov(cfg: SamplingConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    target = logits_to_probs(torch.randn(V, V, generator=gen) * 1.5, cfg)
    draft = (torch.randn(V, V, generator=gen) * 1.5).softmax(-1)
    return target, draft


def _random_tree(root: int, kind: str, target, draft, gen) -> tuple[TokenTree, torch.Tensor]:
    """A tree of random shape whose children are drawn from ``draft`` as ``kind`` says; its target rows."""
    n = int(torch.randint(1, 20, (1,), generator=gen))
    parents, kids = [-1], [0]
    for _ in range(1, n):
        open_nodes = [j for j in range(len(parents)) if kids[j] < MAX_KIDS]
        p = open_nodes[int(torch.randint(len(open_nodes), (1,), generator=gen))]
        parents.append(p)
        kids.append(0)
        kids[p] += 1
    tokens = [root] + [0] * (n - 1)
    for v in range(n):  # parents precede children: node v's token is known when its children are drawn
        children = [c for c in range(n) if parents[c] == v]
        if not children:
            continue
        q = draft[tokens[v]]
        if kind == "topk":
            drawn = torch.topk(q, len(children)).indices.tolist()
        else:
            drawn = torch.multinomial(q, len(children), replacement=kind == "iid", generator=gen).tolist()
        for c, x in zip(children, drawn):
            tokens[c] = x
    tok = torch.tensor(tokens)
    tree = TokenTree.from_any_order(tok, torch.tensor(parents), draft[tok], kind)
    return tree, target[tree.tokens]


def _batch(roots, kinds, target, draft, gen, label=None):
    """Trees rooted at ``roots`` (None: a skipped row) and their ``[B, m, V]`` target rows."""
    trees, rows = [], []
    for root, kind in zip(roots, kinds):
        if root is None:
            trees.append(None)
            rows.append(None)
            continue
        tree, p = _random_tree(root, kind, target, draft, gen)
        if label is not None:
            tree = TokenTree(tree.tokens, tree.parents, tree.draft_probs, label)
        trees.append(tree)
        rows.append(p)
    width = max(t.n for t in trees if t is not None) + 2
    probs = torch.full((len(trees), width, V), float("nan"))  # padding rows must be ignored
    for b, p in enumerate(rows):
        if p is not None:
            probs[b, : p.shape[0]] = p
    return trees, probs


def _verify_rows(roots, kinds, target, draft, gen, label=None):
    """One batched call over trees rooted at ``roots``; the emitted tokens (None for skipped rows)."""
    trees, probs = _batch(roots, kinds, target, draft, gen, label)
    verdicts = verify_stochastic_batch(trees, probs, gen)
    return [None if v is None else v.new_tokens(t) for v, t in zip(verdicts, trees)]


def _joint(kinds, cfg, seed=0, samples=SAMPLES, label=None):
    target, draft = _markov(cfg, 7)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(samples // BATCH):
        outs = _verify_rows([0] * BATCH, kinds, target, draft, gen, label)
        short = [b for b, o in enumerate(outs) if len(o) == 1]
        if short:  # the next step: fresh trees rooted at the first tokens, batched too (others skipped)
            roots = [outs[b][0] if b in short else None for b in range(BATCH)]
            more = _verify_rows(roots, kinds, target, draft, gen, label)
            for b in short:
                outs[b] = outs[b] + more[b][:1]
        for o in outs:
            counts[o[0], o[1]] += 1
    return counts, target[0][:, None] * target


_CFGS = [SamplingConfig(0.7, top_p=0.8), SamplingConfig(1.3, top_k=3), SamplingConfig(1.0)]
_KINDS = {"topk": ("topk",) * BATCH, "iid": ("iid",) * BATCH, "no_replacement": ("no_replacement",) * BATCH,
          "mixed": ("topk", "iid", "no_replacement", "iid")}


@pytest.mark.slow
@pytest.mark.parametrize("cfg", _CFGS, ids=["t0.7-top_p0.8", "t1.3-top_k3", "t1"])
@pytest.mark.parametrize("kinds", list(_KINDS), ids=list(_KINDS))
def test_batch_lossless_on_random_shapes(kinds, cfg):
    counts, want = _joint(_KINDS[kinds], cfg)
    assert int(counts.sum()) == SAMPLES
    assert not chi2_fails(counts, want)


@pytest.mark.parametrize("draw,label", [("no_replacement", "iid"), ("topk", "no_replacement")])
def test_batch_mislabelled_proposal_is_detected(draw, label):
    counts, want = _joint((draw,) * BATCH, SamplingConfig(1.0), label=label)
    assert chi2_fails(counts, want)


# --------------------------------------------------------------------------- device-to-host copies

#: Tensor methods that read a tensor's data on the host (each a device-to-host copy and a sync on CUDA).
_HOST_READS = {"tolist", "item", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__", "__array__"}
#: aten ops that read device data on the host or need it for their output's shape.
_SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "repeat_interleave",
                "equal", "is_nonzero", "allclose")


class _HostReads(TorchFunctionMode):
    """Records every torch call; ``reads`` are those reading tensor data on the host."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        self.calls.append(name)
        kwargs = kwargs or {}
        to_cpu = name == "to" and any(str(a) == "cpu" for a in list(args[1:]) + list(kwargs.values()))
        if name in _HOST_READS or to_cpu:
            self.reads.append(name)
        return func(*args, **kwargs)


class _SyncingOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if any(name == s or name.startswith(s + "_") for s in _SYNCING_OPS):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _count(fn):
    reads, ops = _HostReads(), _SyncingOps()
    with reads, ops:
        out = fn()
    return out, reads, ops


@pytest.mark.parametrize("kinds", list(_KINDS), ids=list(_KINDS))
def test_one_host_copy_per_call(kinds):
    """One ``tolist`` (the copy), nothing that syncs on the device, and the copy is the last torch
    call: the walks read only the host list."""
    target, draft = _markov(SamplingConfig(0.8, top_p=0.9), 3)
    gen = torch.Generator().manual_seed(0)
    for trial in range(5):
        trees, probs = _batch([0, None, 3, 1], _KINDS[kinds], target, draft, gen)
        out, reads, ops = _count(lambda: verify_stochastic_batch(trees, probs, gen))
        assert out[1] is None and all(v is not None for b, v in enumerate(out) if b != 1)
        assert reads.reads == ["tolist"] and reads.calls[-1] == "tolist", (trial, reads.reads, reads.calls[-3:])
        assert ops.ops == [], (trial, ops.ops)
    tree, p = _random_tree(2, _KINDS[kinds][2], target, draft, gen)
    _, reads, ops = _count(lambda: verify_stochastic(tree, p, gen))  # the one-tree API
    assert reads.reads == ["tolist"] and reads.calls[-1] == "tolist" and ops.ops == []


def test_engine_sampling_verify_copies_once_per_batch():
    """``SpecDecoder._verify`` under sampling: one host read for the whole batch (mixed tree sizes)."""
    from tests.specdec.helpers import RandomTreeDrafter, tiny_model

    model = tiny_model("llama")
    dec = specdec.SpecDecoder(model, RandomTreeDrafter(seed=4), tree_size=9, attn_impl="torch")
    seen = []
    real = dec._verify

    def counted(run, trees, logits):
        verdicts, reads, ops = _count(lambda: real(run, trees, logits))
        seen.append((reads.reads, ops.ops, len(trees)))
        return verdicts

    dec._verify = counted
    prompts = [torch.tensor([5, 9, 11, 4]), torch.tensor([7, 3]), torch.tensor([8, 8, 8, 1, 2])]
    dec.generate(prompts, 6, do_sample=True, temperature=0.9, top_p=0.9, generator=torch.Generator().manual_seed(0))
    assert seen and all(r == ["tolist"] and o == [] and b == 3 for r, o, b in seen), seen


# --------------------------------------------------------------------------- edges and errors


def test_no_mass_left_falls_back_to_a_child_with_mass():
    """``topk`` children covering the whole support of a row that sums to less than 1 (only rounding
    gets close to this in real use): a rejection of the last child leaves a residual with no mass;
    the bonus is then the last child with target mass, never a zero-probability token."""
    tree = TokenTree(torch.tensor([4, 0, 1]), torch.tensor([-1, 0, 0]))
    probs = torch.zeros(3, V)
    probs[0, :2] = 0.3
    probs[1:] = 1.0 / V
    gen = torch.Generator().manual_seed(0)
    seen = {verify_stochastic(tree, probs, gen).new_tokens(tree)[0] for _ in range(200)}
    assert seen == {0, 1}


def test_no_mass_at_all_is_an_error():
    tree = TokenTree(torch.tensor([4, 0]), torch.tensor([-1, 0]))
    probs = torch.full((2, V), float("nan"))
    with pytest.raises(ValueError, match=r"target_probs: expected rows with positive mass"):
        verify_stochastic(tree, probs, torch.Generator().manual_seed(0))


def test_batch_errors():
    tree = TokenTree(torch.tensor([0, 3, 1]), torch.tensor([-1, 0, 1]))
    with pytest.raises(ValueError, match=r"target_probs: expected a float tensor of shape \[B, m, V\]"):
        verify_stochastic_batch([tree], torch.zeros(3, V))
    with pytest.raises(ValueError, match=r"target_probs: expected 2 sequences \(one per tree\), got 1"):
        verify_stochastic_batch([tree, None], torch.zeros(1, 3, V))
    with pytest.raises(ValueError, match=r"target_probs: expected at least 3 rows for trees\[1\]"):
        verify_stochastic_batch([None, tree], torch.zeros(2, 2, V))
    sampled = TokenTree(torch.tensor([0, 3]), torch.tensor([-1, 0]), None, "iid")
    with pytest.raises(ValueError, match=r"tree.draft_probs: expected \[n, V\] proposal probabilities"):
        verify_stochastic_batch([tree, sampled], torch.full((2, 3, V), 0.2))
    assert verify_stochastic_batch([None, None], torch.zeros(2, 1, V)) == [None, None]


@pytest.mark.parametrize("block", [1, 2, 3, 7, 1024])
def test_inverse_cdf_draws_each_row_from_its_distribution(block, monkeypatch):
    """The bonus sampler alone, with blocks of 1 / 2 / 3 / 7 / 1024 tokens (V = 7: a short last block,
    one block, blocks of one token): each row's draws follow the row normalised; zero-probability
    tokens never come out, also where a whole block has none; a row with no mass gives V."""
    import specdec.sampling as sampling_mod

    monkeypatch.setattr(sampling_mod, "CDF_BLOCK", block)
    gen = torch.Generator().manual_seed(block)
    rows = (torch.randn(3, 7, generator=gen) * 2).softmax(-1) * torch.tensor([[1.0], [0.5], [3.0]])
    rows[1, [0, 4]] = 0.0
    rows[2, [3, 4, 5]] = 0.0  # a whole block of 3 without mass
    rows = torch.cat([rows, torch.zeros(1, 7)])
    draws = 6000
    counts = torch.zeros(3, 7)
    for _ in range(draws // 100):
        u = torch.rand(100, 4, dtype=torch.float64, generator=gen)
        for k in range(100):
            idx = sampling_mod.sample_inverse_cdf(rows, u[k])
            assert int(idx[3]) == 7
            counts[torch.arange(3), idx[:3]] += 1
    assert counts[1, 0] == 0 and counts[1, 4] == 0 and counts[2, 3:6].sum() == 0
    top = torch.tensor([1.0 - 2.0**-53] * 4, dtype=torch.float64)  # u * total may round up to total
    assert sampling_mod.sample_inverse_cdf(rows, top).tolist() == [6, 6, 6, 7] and rows[1, 6] > 0
    tail = rows.clone()
    tail[0, 5:] = 0.0  # the top of u lands on the last token with mass, not in an empty last block
    assert sampling_mod.sample_inverse_cdf(tail, top).tolist() == [4, 6, 6, 7]
    for r in range(3):
        assert not chi2_fails(counts[r], rows[r] / rows[r].sum())


# --------------------------------------------------------------------------- the verdict's exact law


def _exact_verdicts(tree: TokenTree, p_rows: torch.Tensor, q_rows: torch.Tensor, kind: str) -> dict:
    """(path, bonus) -> probability under the module docstring's rule, enumerated in float64."""
    out: dict = {}
    tokens, children = tree.token_list, tree.children

    def visit(node, path, prob):
        p = p_rows[node].double()
        q = None if kind == "topk" else q_rows[node].double()
        for c in children[node]:
            x = tokens[c]
            if kind == "topk":
                a = float(p[x])
            else:
                a = (1.0 if p[x] > 0 else 0.0) if q[x] == 0 else min(1.0, float(p[x] / q[x]))
            if a > 0:
                visit(c, path + (c,), prob * a)
            prob *= 1 - a
            if prob <= 0:
                return
            rest = p.clone()
            if kind == "topk":
                rest[x] = 0.0
            else:
                rest = (p - q).clamp(min=0.0)
                if kind == "no_replacement":
                    q2 = q.clone()
                    q2[x] = 0.0
                    q = q2 / q2.sum() if q2.sum() > 0 else q
            p = rest / rest.sum() if rest.sum() > 0 else p
        for y in range(p.shape[0]):
            if p[y] > 0:
                out[(path, y)] = out.get((path, y), 0.0) + prob * float(p[y] / p.sum())

    visit(0, (0,), 1.0)
    return out


@pytest.mark.parametrize("kind", ["topk", "iid", "no_replacement"])
def test_verdicts_follow_the_exact_law_of_the_rule(kind):
    """Stronger than the two-token joints: the whole verdict (accepted path, bonus) of one fixed
    21-node tree (duplicate siblings, a top-k-warped target favouring the drafted tokens so that
    deep paths are common) against its exact distribution, enumerated from the rule."""
    from tests.drafters.lossless import chi2_pvalue

    vocab = 8
    toks = [7, 0, 0, 0, 1, 6, 1, 6, 2, 1, 0, 0, 1, 4, 0, 0, 0, 1, 1, 6, 2]
    par = [-1, 0, 1, 2, 2, 2, 1, 1, 7, 0, 9, 10, 9, 0, 0, 14, 15, 15, 14, 14, 19]
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(len(toks), vocab, generator=gen)
    for c in range(1, len(toks)):
        logits[par[c], toks[c]] += 2.5
    p_rows = logits_to_probs(logits, SamplingConfig(0.9, top_k=4))
    q_rows = (torch.randn(len(toks), vocab, generator=gen) + 0.8 * logits).softmax(-1)
    tree = TokenTree(torch.tensor(toks), torch.tensor(par), q_rows, kind)
    law = _exact_verdicts(tree, p_rows, q_rows, kind)
    assert abs(sum(law.values()) - 1.0) < 1e-9
    counts: dict = {}
    for _ in range(6000):
        v = verify_stochastic(tree, p_rows, gen)
        counts[(v.path, v.bonus_token)] = counts.get((v.path, v.bonus_token), 0) + 1
    cells = sorted(set(law) | set(counts))
    assert all(law.get(c, 0.0) > 0 for c in counts), [c for c in counts if law.get(c, 0.0) == 0]
    assert len(law) >= 8  # deep paths and several bonuses are exercised
    observed = torch.tensor([float(counts.get(c, 0)) for c in cells])
    pval = chi2_pvalue(observed, torch.tensor([law.get(c, 0.0) for c in cells]))
    assert pval > 1e-3, pval
