"""The tables of a BATCHED launch: one launch of a kernel for several sequences, each over tensors of its own.

Row b of a launch's pointer table holds sequence b's tensors' addresses, row b of its value table its values (sizes,
strides, counts), each in the order of the kernel's names for them; the kernel finds its sequence's row from its
grid and reads entry i of it (`table_pointer` turns an address back into a typed pointer). The tables are uploaded
from pinned host memory without a synchronisation, so that a CUDA graph may capture the upload: their host copies
must then live as long as the graph (`keep`: a list of them, as engine.model.batch_graph keeps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INT32 = (-(2**31), 2**31 - 1)
ALIGN = 16  # bytes of an address, elements of a stride (the divisibility Triton specialises a launch on)


# Where a launch's tables go (`table`): a list of their host copies, or nowhere (None)
Keep = list | None


def table(rows: list[list[int]], device: torch.device, keep: Keep) -> torch.Tensor:
    """[B, W] int64 on `device`: on a GPU copied from pinned host memory without a synchronisation (a CUDA graph
    may capture the copy: its host copy then goes into the list `keep`, to live as long as the graph)."""
    host = torch.tensor(rows, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    host = host.pin_memory()
    if keep is not None:
        keep.append(host)
    return host.to(device, non_blocking=True)


def check_width(batch: dict, pointers: tuple[str, ...], params: tuple[str, ...]) -> None:
    """A launch's tables hold a row of its pointers' and its values' names (the kernel reads them by position)."""
    if batch["table_ptr"].shape[1] != len(pointers) or batch["params_ptr"].shape[1] != len(params):
        raise AssertionError(f"tables of {batch['table_ptr'].shape[1]} pointers and {batch['params_ptr'].shape[1]} "
                             f"values, the kernel reads {len(pointers)} and {len(params)}")


def batch_tables(calls: list, pointers, params, names: tuple[tuple[str, ...], tuple[str, ...]],
                 device: torch.device, keep: Keep, hinted=lambda call: (), int32: bool = True,
                 tiles: tuple[str, ...] = ()) -> dict:
    """The options of a BATCHED launch of `calls`: tables of their tensors' addresses (pointers(call): the tensors,
    in the order of names[0]) and of their values (params(call): ints, in the order of names[1]; with int32 each
    read by the kernel as an int32, as a lone launch passes it, and refused outside that range; else as an int64),
    a row per call (keep gets their host copies: `table`), and ALIGNED: whether the addresses of the entries named
    in `tiles` (those whose tiles the kernel loads or stores, taken as multiples of 16 bytes under ALIGNED; the
    others, such as a sequence's positions sliced out of a batch's, are not) and the strides hinted(call) the kernel
    takes as multiples of 16 are (`aligned`)."""
    values = [params(c) for c in calls]
    if int32 and any(not INT32[0] <= v <= INT32[1] for row in values for v in row):
        raise ValueError(f"a batched launch's values are int32s: {values}")
    at = [names[0].index(name) for name in tiles]
    rows = [pointers(c) for c in calls]
    batch = dict(table_ptr=table([[t.data_ptr() for t in row] for row in rows], device, keep),
                 params_ptr=table(values, device, keep),
                 BATCHED=True, TABLE_W=len(names[0]), PARAMS_W=len(names[1]),
                 ALIGNED=all(aligned([row[i] for i in at], hinted(c)) for row, c in zip(rows, calls)))
    check_width(batch, *names)
    return batch


def aligned(tensors, values=()) -> bool:
    """Whether every tensor's address is a multiple of ALIGN bytes and every value (a stride in elements) a multiple
    of ALIGN: what a lone launch's arguments are specialised on, and what a BATCHED kernel may then assume of its
    tables' entries (`table_pointer`, `table_stride`): without it its loads of a tile are not vectorised."""
    return all(t.data_ptr() % ALIGN == 0 for t in tensors) and all(int(v) % ALIGN == 0 for v in values)


@triton.jit
def table_pointer(row, i, like, ALIGNED: tl.constexpr = False):
    """Entry i of a table's row (an address) as a pointer to like's element type (BATCHED launches); ALIGNED: the
    address is a multiple of 16 bytes (`aligned`)."""
    pointer = tl.load(row + i).to(tl.pointer_type(like.dtype.element_ty))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def table_stride(row, i, ALIGNED: tl.constexpr = False):
    """Entry i of a table's row, a stride in elements; ALIGNED: a multiple of 16 (`aligned`)."""
    stride = tl.load(row + i)
    if ALIGNED:
        stride = tl.multiple_of(stride, 16)
    return stride
