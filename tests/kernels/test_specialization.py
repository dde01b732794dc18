"""A step's kernels (a decode step's, a question's prefill's) compile once for contexts of any length: Triton compiles
a kernel anew for each pattern of its integer arguments' divisibility by 16 (and of its pointers' alignment), so an
argument that follows the context's length (its key count, its centroids, a tensor's row stride of that length)
would make a new document's first question wait for a compile. The keys are Triton's own (native_specialize_impl,
do_not_specialize honoured); the kernels run in the interpreter without CUDA (tests/conftest.py)."""

from __future__ import annotations

import inspect

import pytest
import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import native_specialize_impl

from kernels import (
    causal_ops,
    centroid_ops,
    compact_ops,
    follow_ops,
    pages_ops,
    sparse_ops,
    suffix_ops,
    tally_ops,
    union_ops,
)
from kernels.layout import group_starts
from kernels.selection import FollowRows, KeyCount, Selection, StepTally

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HQ, HKV, D, SINK, TAIL = 8, 2, 64, 2, 4
KERNELS = [(suffix_ops, "suffix_block_kernel"), (suffix_ops, "suffix_merge_kernel"),
           (centroid_ops, "centroid_denominator_kernel"), (centroid_ops, "centroid_score_kernel"),
           (centroid_ops, "centroid_score_prefill_kernel"), (centroid_ops, "centroid_cut_kernel"),
           (compact_ops, "group_block_sums_kernel"), (compact_ops, "expand_groups_kernel"),
           (tally_ops, "tally_step_kernel"), (sparse_ops, "sparse_attn_fwd_kernel"),
           (sparse_ops, "sparse_attn_merge_kernel"), (follow_ops, "follow_attn_kernel"),
           (causal_ops, "causal_attn_fwd_kernel"),
           (pages_ops, "page_scores_kernel"), (pages_ops, "page_threshold_kernel"), (pages_ops, "page_write_kernel"),
           (union_ops, "union_attn_fwd_kernel"), (union_ops, "union_merge_kernel")]
PAGE = 16
PREFILL = 20  # a question's tokens: more query rows than a decode step's split kernel takes


def specialization(kernel, args: tuple, kwargs: dict) -> tuple:
    """The part of the key Triton compiles `kernel` under that a launch's arguments other than its constexprs make:
    their types and specialisations (those in do_not_specialize: their types only). (A constexpr tile may follow a
    context's size by powers of two: a compile per doubling, not per context.)"""
    fn = kernel.fn if hasattr(kernel, "fn") else kernel
    fn = getattr(fn, "fn", fn)  # (a JITFunction's or the interpreter's wrapper of it)
    options = getattr(kernel, "kwargs", None) or {}
    skipped = set(options.get("do_not_specialize") or getattr(kernel, "do_not_specialize", None) or [])
    signature = inspect.signature(fn)
    bound = signature.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
    key = []
    for i, (name, param) in enumerate(signature.parameters.items()):
        value = bound.arguments.get(name, param.default)
        if "constexpr" in str(param.annotation):
            continue
        if value is None or isinstance(value, (bool, float)):
            key.append((name, type(value).__name__))
        else:
            specialize = name not in skipped and i not in skipped
            key.append((name, native_specialize_impl(BaseBackend, value, False, specialize, True)))
    return tuple(key)


class _Recorded:
    """A kernel whose launches record their specialisation, then run."""

    def __init__(self, kernel, keys: list):
        self.kernel, self.keys = kernel, keys

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys.append(specialization(self.kernel, args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


def _steps(n: int, c: int, slots: int, seed: int = 0) -> None:
    """Over a context of n keys (the first SINK and the last TAIL dense) in c clusters a head, with `slots`
    new-token slots: a decode step's follow rows (found among the context's n tokens), its squeeze lookup (a cut at
    a tenth of the keys) and its attention (8 follow rows through the clusters' layout, the step's statistics with
    the clusters' scores); Quest's lookup and full attention's step; a question's prefill (PREFILL tokens: the
    lookup and the attention of a prefill)."""
    g = torch.Generator().manual_seed(seed)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    ids = on(torch.randint(0, 50, (n,), generator=g))
    suffix_ops.follow_step(ids, on(torch.ones(n, dtype=torch.bool)), ids[-3:].clone(), ids[-1:].clone(),
                           on(torch.full((8,), -1, dtype=torch.int64)), on(torch.empty(16, dtype=torch.int64)))
    q = on(torch.randn(HQ, 1, D, generator=g))
    k, v = (on(torch.randn(HKV, n, D, generator=g)) for _ in range(2))
    centroids = on(torch.randn(HKV, c, D, generator=g))
    starts = group_starts(torch.randint(0, c, (HKV, n - TAIL), generator=g), c)
    counts = on((starts[:, 1:] - starts[:, :-1]).to(torch.int32))
    keep, _, selection = centroid_ops.cluster_select(q, centroids, counts, D ** -0.5, 0.0, HKV, on(starts), n - TAIL,
                                                     TAIL, keys=KeyCount.of(0.1 * HKV * n))
    k_new, v_new = (on(torch.randn(HKV, slots, D, generator=g)) for _ in range(2))
    q_pos = on(torch.tensor([n + 4]))
    indexed = n - TAIL - SINK
    order = on(torch.stack([torch.randperm(indexed, generator=g) for _ in range(HKV)]).to(torch.int32))
    follow = FollowRows(on(torch.randint(-1, n, (8,), generator=g)), SINK, indexed, order)
    tally = StepTally(on(torch.rand(3, generator=g)), on(torch.zeros(HKV)), on(torch.zeros(1)), on(torch.rand(HKV, c)),
                      on(torch.zeros(HKV, c)))
    out = torch.empty(1, HQ, D, device=DEVICE).transpose(0, 1)
    union_ops.union_attention(q, k, v, selection, 0.125, k_new, v_new, q_pos, n, follow, out, tally=tally)
    tally_ops.tally_step(selection.indptr, tally.elements, tally.kept, tally.read, None, tally.scores, tally.best)
    compact_ops.expand_groups(keep, on(starts), n - TAIL, TAIL)  # (an expansion that sums its own blocks)
    questions = on(torch.randn(HQ, PREFILL, D, generator=g))
    _, _, asked = centroid_ops.cluster_select(questions, centroids, counts, D ** -0.5, 0.0, HKV, on(starts),
                                              n - TAIL, TAIL, keys=KeyCount.of(0.1 * HKV * n))
    union_ops.union_attention(questions, k, v, asked, 0.125, k_new, v_new, on(torch.arange(n, n + PREFILL)), n,
                              follow, torch.empty(PREFILL, HQ, D, device=DEVICE).transpose(0, 1))
    pages = n // PAGE
    bounds = [on(torch.randn(HKV, pages, D, generator=g)) for _ in range(2)]
    _, quest = pages_ops.select_pages(pages_ops.page_scores(q, *bounds, HKV), max(1, pages // 10), PAGE, n)
    union_ops.union_attention(q, k, v, quest, 0.125, k_new, v_new, q_pos, n, None, out)
    union_ops.union_attention(q, k, v, None, 0.125, k_new, v_new, q_pos, n, None, out)


@pytest.mark.parametrize("second", [(704, 48), (710, 37), (520, 26)],
                         ids=["704-keys-48-clusters", "710-keys-704-indexed", "520-keys-32-pages"])
def test_a_decode_steps_kernels_compile_once_for_contexts_of_any_length(monkeypatch, second):
    """Two contexts of different sizes (700 keys in 35 clusters a head, and `second`, whose keys, indexed keys,
    clusters or pages are multiples of 16): every kernel of the step launches under the same specialisation."""
    keys: dict[str, list] = {}
    for module, name in KERNELS:
        monkeypatch.setattr(module, name, _Recorded(getattr(module, name), keys.setdefault(name, [])))
    _steps(700, 35, 64)
    _steps(*second, 64, seed=1)
    anew = {}
    for name, launches in keys.items():
        half = len(launches) // 2
        assert half and len(launches) == 2 * half, f"{name} launched {len(launches)} times over two steps"
        differ = {a[0] for one, other in zip(launches[:half], launches[half:]) for a, b in zip(one, other) if a != b}
        if differ:
            anew[name] = sorted(differ)
    assert not anew, f"kernels compiled anew for another context, by argument: {anew}"


def _union_call(n: int, seed: int) -> union_ops.UnionCall:
    """A decode step's attention over a context of n keys of its own: a tenth of them selected, 8 follow rows."""
    g = torch.Generator().manual_seed(seed)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    mask = torch.rand(HKV, n, generator=g) < 0.1
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), mask.sum(dim=1).cumsum(0)])
    selection = Selection(on(indptr), on(mask.nonzero()[:, 1].to(torch.int32)), n)
    indexed = n - TAIL - SINK
    order = on(torch.stack([torch.randperm(indexed, generator=g) for _ in range(HKV)]).to(torch.int32))
    follow = FollowRows(on(torch.randint(-1, n, (8,), generator=g)), SINK, indexed, order)
    q, k, v = (on(torch.randn(h, length, D, generator=g)) for h, length in ((HQ, 1), (HKV, n), (HKV, n)))
    k_new, v_new = (on(torch.randn(HKV, 64, D, generator=g)) for _ in range(2))
    out = torch.empty(1, HQ, D, device=DEVICE).transpose(0, 1)
    return union_ops.UnionCall(q, k, v, selection, 0.125, k_new, v_new, on(torch.tensor([n + 4])), n, follow, out)


def test_a_batchs_launches_compile_once_whoever_is_in_it(monkeypatch):
    """Sequences over contexts of their own answered together (one split and one merge launch, each sequence's
    values read from tables): the launches of two batches of different members share their specialisation."""
    keys: dict[str, list] = {}
    for name in ("union_attn_fwd_kernel", "union_merge_kernel"):
        monkeypatch.setattr(union_ops, name, _Recorded(getattr(union_ops, name), keys.setdefault(name, [])))
    union_ops.union_attention_batch([_union_call(700, 0), _union_call(704, 1)])
    union_ops.union_attention_batch([_union_call(413, 2), _union_call(710, 3), _union_call(700, 0)])
    for name, (first, other) in keys.items():
        assert [a[0] for a, b in zip(first, other) if a != b] == [], name
