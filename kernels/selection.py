"""The contract between a method's lookup and the sparse attention: which fixed-context keys each row attends to."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class Selection:
    """Keys of the fixed context that each row of heads attends to, in CSR form.

    A row is either one query head (``rows == Hq``) or one KV head whose query heads share the
    selection (``rows == Hkv``, the GQA-friendly form: each selected key is read once per group).
    Row ``r`` reads KV head ``r * Hkv // rows``.

    indptr:  [rows + 1] int64, non-decreasing, indptr[0] == 0
    indices: [nnz] int64, rows of the fixed K/V (in [0, num_keys)), sorted within each row
    num_keys: length of the fixed K/V the indices point into
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    num_keys: int

    @property
    def rows(self) -> int:
        return self.indptr.numel() - 1

    def counts(self) -> torch.Tensor:
        """[rows] int64: selected keys per row."""
        return self.indptr[1:] - self.indptr[:-1]

    @staticmethod
    def from_mask(mask: torch.Tensor) -> "Selection":
        """mask: [rows, num_keys] bool -> Selection (vectorised, no loop over rows)."""
        counts = mask.sum(dim=1)
        indptr = torch.zeros(mask.shape[0] + 1, dtype=torch.int64, device=mask.device)
        indptr[1:] = torch.cumsum(counts, dim=0)
        indices = mask.nonzero(as_tuple=False)[:, 1].contiguous()  # row-major: sorted within each row
        return Selection(indptr=indptr, indices=indices, num_keys=mask.shape[1])

    def to_mask(self) -> torch.Tensor:
        """[rows, num_keys] bool: the dense form (for tests, references and statistics). Entries of `indices` past
        indptr[-1] (spare capacity, as the GPU expansion leaves) are ignored. Without host synchronisation: every
        entry is scattered, those past indptr[-1] into a spare row that is dropped."""
        device = self.indptr.device
        if self.num_keys == 0:
            return torch.zeros(self.rows, 0, dtype=torch.bool, device=device)
        entry = torch.arange(self.indices.numel(), device=device)
        row = torch.searchsorted(self.indptr[1:].to(torch.int64).contiguous(), entry, right=True)  # rows: spare
        mask = torch.zeros(self.rows + 1, self.num_keys, dtype=torch.bool, device=device)
        mask[row, self.indices.to(torch.int64).clamp(0, max(self.num_keys - 1, 0))] = True
        return mask[: self.rows]

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row key indices padded to the longest row.

        Returns idx [rows, max_count] int64 (padding points at key 0) and valid [rows, max_count] bool.
        """
        counts = self.counts()
        width = int(counts.max().item()) if self.rows > 0 and self.indices.numel() > 0 else 0
        pos = torch.arange(width, device=self.indptr.device)
        valid = pos[None, :] < counts[:, None]
        flat = (self.indptr[:-1, None] + pos[None, :]).clamp(max=max(self.indices.numel() - 1, 0))
        idx = self.indices[flat] if self.indices.numel() else torch.zeros_like(flat)
        return torch.where(valid, idx, torch.zeros_like(idx)), valid


@dataclass(frozen=True)
class FollowRows:
    """The follow rows a step adds to every row of a selection (kernels/jit/follow.py): positions [M] int64 token
    positions (-1: none, no repeats); a layer stores its indexed tokens first (row = position - first, for rows in
    [0, indexed)), through order [Hkv, indexed] int32 (the row of each stored indexed row in the layout the K/V are
    in) or as stored (None)."""

    positions: torch.Tensor
    first: int
    indexed: int
    order: torch.Tensor | None = None


def rows_held(positions: torch.Tensor, lo: int, hi: int, order: torch.Tensor | None,
              starts: torch.Tensor) -> torch.Tensor:
    """[Hkv, U] int64: how many of `positions` [M] within [lo, hi) each unit holds, per KV head: position p lies at
    order[h, p - lo] of head h's layout (order [Hkv, hi - lo]; None: at p - lo), unit u of head h at [starts[h, u],
    starts[h, u + 1]) (starts [Hkv, U + 1]). A host-side count (its mask synchronises with a GPU): the CPU's cuts."""
    hkv, units = starts.shape[0], starts.shape[1] - 1
    out = torch.zeros(hkv, units, dtype=torch.int64, device=starts.device)
    p = positions[(positions >= lo) & (positions < hi)] - lo
    if p.numel() == 0:
        return out
    slots = order[:, p].long() if order is not None else p.expand(hkv, -1)
    unit = torch.searchsorted(starts.contiguous(), slots.contiguous(), right=True) - 1  # [Hkv, m]
    ok = (unit >= 0) & (unit < units)
    return out.scatter_add_(1, unit.clamp(0, units - 1), ok.long())


@dataclass(frozen=True)
class KeyCount:
    """The number of keys a lookup's cut keeps, worked out on the device where the cut runs (inside a GPU lookup's
    kernels: no launch of its own), so that a step's own reads can be taken out of its room:

        max(base - per_listed x #{p in listed: lo <= p < hi} - per_read x (index elements the lookup read), least)

    times the KV heads whose clusters the cut counts where per_head (those not reading fixed lists: a count per
    retrieval head of duo-squeeze). listed: [M] int64 positions on the lookup's device (-1: none), or None; the
    elements read are a candidate-list lookup's own (cluster_keep_list's out_read, summed over its KV heads).
    Computed in float32, in that order. order: where the indexed positions lo .. hi - 1 lie in the layout the units'
    key ranges are in (FollowRows.order, [Hkv, hi - lo] int32; None: as stored), for `held`."""

    base: float
    least: float = float("-inf")
    listed: torch.Tensor | None = None
    lo: int = 0
    hi: int = 0
    per_listed: float = 0.0
    per_read: float = 0.0
    per_head: bool = False
    order: torch.Tensor | None = None

    @staticmethod
    def of(keys: "KeyCount | float") -> "KeyCount":
        """`keys` as a KeyCount (a number: that many keys)."""
        return keys if isinstance(keys, KeyCount) else KeyCount(float(keys))

    def held(self, starts: torch.Tensor) -> torch.Tensor:
        """[Hkv, U] int64: the listed positions within [lo, hi) each unit holds, per KV head, where unit u of head h
        holds the keys at [starts[h, u], starts[h, u + 1]) of the layout (starts [Hkv, U + 1], on the listed
        positions' device). A cut that counts each unit's keys less these reads what it asks: the count takes
        every listed row out once per KV head, and a row inside a kept unit is read with it, not again (the
        CPU's exact cuts; a GPU's cut inside its kernels counts whole units, a few keys under)."""
        if self.listed is None:
            return torch.zeros(starts.shape[0], starts.shape[1] - 1, dtype=torch.int64, device=starts.device)
        return rows_held(self.listed, self.lo, self.hi, self.order, starts)

    def at_least(self, least: float) -> "KeyCount":
        return replace(self, least=max(self.least, float(least)))

    def value(self, read: torch.Tensor | None = None, device: torch.device | None = None,
              heads: int | torch.Tensor | None = None) -> torch.Tensor:
        """[] float32 on `device` (or the listed positions'): the count, in torch (the kernels' reference; the CPU's
        lookups). read: the elements the lookup read ([Hkv] float32), where per_read is set; heads: the KV heads the
        cut counts, where per_head is set."""
        if device is None:
            device = self.listed.device if self.listed is not None else torch.device("cpu")
        f32 = dict(dtype=torch.float32, device=device)
        want = torch.tensor(self.base, **f32)
        if self.listed is not None:
            p = self.listed
            want = want - torch.tensor(self.per_listed, **f32) * ((p >= self.lo) & (p < self.hi)).sum().float()
        if self.per_read:
            if read is None:
                raise ValueError("this count takes the elements the lookup read out: pass them as `read`")
            want = want - torch.tensor(self.per_read, **f32) * read.float().sum()
        want = torch.maximum(want, torch.tensor(self.least, **f32))
        if self.per_head:
            if heads is None:
                raise ValueError("this count is per KV head the cut counts: pass their number as `heads`")
            want = want * torch.as_tensor(heads, device=device).float()
        return want


@dataclass(frozen=True)
class Fixed:
    """Rows that read a fixed list of keys instead of what their lookup kept (DuoAttention's streaming heads).

    lists: [Hkv, W] int32, head h's keys (sorted, in [0, num_keys), the dense tail included if it reads it);
    on: [Hkv] bool, whether the rows of head h read lists[h]. Both on the lookup's device.
    """

    lists: torch.Tensor
    on: torch.Tensor

    @property
    def width(self) -> int:
        return self.lists.shape[1]

    def check(self, hkv: int, device: torch.device) -> None:
        if self.lists.dim() != 2 or self.lists.shape[0] != hkv or self.lists.dtype != torch.int32:
            raise ValueError(f"fixed lists must be int32 [Hkv = {hkv}, W], got {self.lists.dtype} "
                             f"{tuple(self.lists.shape)}")
        if tuple(self.on.shape) != (hkv,) or self.on.dtype != torch.bool:
            raise ValueError(f"fixed on must be bool [Hkv = {hkv}], got {self.on.dtype} {tuple(self.on.shape)}")
        if self.lists.device != device or self.on.device != device:
            raise ValueError(f"fixed lists and on must be on {device}, got {self.lists.device}, {self.on.device}")

    def launch_args(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(lists, on, W) as the expansion kernel takes them."""
        return self.lists.contiguous(), self.on.contiguous(), self.width

    def apply(self, selection: Selection) -> Selection:
        """The reference: `selection`'s rows (row r of head r * Hkv // rows) of marked heads replaced."""
        hkv = self.lists.shape[0]
        self.check(hkv, selection.indptr.device)
        head = torch.arange(selection.rows, device=self.on.device) * hkv // max(selection.rows, 1)
        return replace_rows(selection, self.on[head], self.lists[head])


def entry_rows(counts: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSR rows of `counts` [rows] int64 keys each, laid out in a buffer of `capacity` entries: (indptr [rows + 1]
    int64, row [capacity], offset [capacity]: each entry's row and its place in that row). Entries past indptr[-1]
    (spare capacity) fall in the last row, past its count. On the device, without host synchronisation."""
    rows = counts.numel()
    indptr = torch.zeros(rows + 1, dtype=torch.int64, device=counts.device)
    indptr[1:] = torch.cumsum(counts, dim=0)
    entry = torch.arange(capacity, device=counts.device)
    row = torch.searchsorted(indptr[1:], entry, right=True).clamp(max=max(rows - 1, 0))
    return indptr, row, entry - indptr[row]


def replace_rows(selection: Selection, take: torch.Tensor, fixed: torch.Tensor) -> Selection:
    """The rows of `selection` where `take` [rows] bool is set replaced by `fixed` [rows, W] (each row's keys,
    sorted; only the taken rows are read); the other rows as they are. On the device, without host
    synchronisation: the new indices buffer holds selection.indices.numel() + rows * W entries (a static size), of
    which indptr[-1] are used."""
    rows, width = fixed.shape
    if take.shape != (rows,) or selection.rows != rows:
        raise ValueError(f"take must be [{selection.rows}] and fixed [{selection.rows}, W]; got {tuple(take.shape)}, "
                         f"{tuple(fixed.shape)}")
    counts = torch.where(take, torch.full_like(selection.counts(), width), selection.counts())
    indptr, row, offset = entry_rows(counts, selection.indices.numel() + rows * width)
    last = max(selection.indices.numel() - 1, 0)
    mine = selection.indices[(selection.indptr[row] + offset).clamp(0, last)] if selection.indices.numel() \
        else torch.zeros_like(offset, dtype=fixed.dtype)
    theirs = fixed[row, offset.clamp(0, max(width - 1, 0))] if width else torch.zeros_like(mine)
    indices = torch.where(take[row], theirs.to(mine.dtype), mine)
    return Selection(indptr=indptr, indices=indices, num_keys=selection.num_keys)


def contains(selection: Selection, rows: torch.Tensor) -> torch.Tensor:
    """Whether each of `rows` [R, M] (keys, R = selection.rows) is in its row of `selection`: [R, M] bool. Uses the
    rows' order (sorted within each row). On the device, without host synchronisation: one pass over the indices
    buffer (its spare capacity sorts after every row) and a binary search per key."""
    r, n = selection.rows, max(selection.num_keys, 1)
    capacity = selection.indices.numel()
    if capacity == 0:
        return torch.zeros_like(rows, dtype=torch.bool)
    entry = torch.arange(capacity, device=rows.device)
    row = torch.searchsorted(selection.indptr[1:].contiguous(), entry, right=True)  # r: spare capacity
    codes = torch.where(row < r, row * n + selection.indices.to(torch.int64).clamp(0, n - 1), r * n + entry)
    wanted = torch.arange(r, device=rows.device)[:, None] * n + rows  # [R, M]
    at = torch.searchsorted(codes, wanted.reshape(-1)).clamp(max=capacity - 1).reshape(wanted.shape)
    return codes[at] == wanted



@dataclass(frozen=True)
class StepTally:
    """What one lookup's step adds into a turn's statistics, besides its selection's counts and the follow rows it
    read (kernels.reference.tally.tally_step's other arguments): elements [E] the index elements the lookup read
    (summed into read), kept [R] float32 (each row's keys added), read [1] float32, and scores [R, U] the lookup's
    unit scores maxed into best [R, U] float32 (both None: no running max this step)."""

    elements: torch.Tensor
    kept: torch.Tensor
    read: torch.Tensor
    scores: torch.Tensor | None = None
    best: torch.Tensor | None = None
