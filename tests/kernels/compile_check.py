"""Compile kernel variants for an H100 (sm_90) with the installed Triton, no GPU needed.

    python -m tests.kernels.compile_check                      the centroid lookup's and the expansion's variants
    python -m tests.kernels.compile_check --launches FILE ...  every variant a recorded test run launched
    python -m tests.kernels.compile_check --ptx LABEL          the PTX of one listed variant

(TRITON_INTERPRET unset or 0: under the interpreter nothing compiles.) The interpreter runs what Triton's compiler
may refuse (a constexpr's type, a nested function's argument), so a kernel variant the CPU tests pass can still fail
on a GPU. To check every variant the CPU tests launch, before a GPU run:

    SQUEEZE_KERNEL_LAUNCHES=/tmp/launches python -m pytest -q tests/kernels tests/engine
    python -m tests.kernels.compile_check --launches /tmp/launches*

(tests/kernels/launches.py records them). Prints one line per variant; exits 1 if any does not compile.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
FLOATS = {"scale2", "threshold", "key_base", "key_least", "per_listed", "per_read", "read_base", "read_per"}
POINTERS = {"q_ptr": "*bf16", "cent_ptr": "*u8", "step_ptr": "*fp32", "part_max_ptr": "*fp32",
            "part_sum_ptr": "*fp32", "s_ptr": "*fp32", "keep_ptr": "*u8", "score_ptr": "*fp32", "starts_ptr": "*i64",
            "block_sums_ptr": "*i64", "hist_ptr": "*i32", "on_ptr": "*u8", "cut_ptr": "*fp32", "listed_ptr": "*i64",
            "sync_ptr": "*i32", "counts_ptr": "*i64", "indptr_ptr": "*i64", "idx_ptr": "*i64", "out_ptr": "*i32",
            "fixed_ptr": "*i32", "fixed_on_ptr": "*u8", "allowed_ptr": "*u8", "valid_ptr": "*i64",
            "elements_ptr": "*fp32"}


def compile_variant(kernel, constexprs: dict, pointers: tuple[str, ...] = ()):
    """kernel compiled for TARGET with `constexprs` (the rest at their defaults); a pointer argument that defaults to
    None stays None (an unused one) unless named in `pointers`; every other argument a runtime value (int32 or
    float32, by name). Returns the compiled kernel (its `asm`: "ptx", ...)."""
    params = inspect.signature(kernel.fn).parameters
    signature, values = {}, {}
    for i, (name, param) in enumerate(params.items()):
        constexpr = "constexpr" in str(param.annotation)
        if name in constexprs or constexpr or (param.default is None and name not in pointers):
            signature[name] = "constexpr"
            values[(i,)] = constexprs.get(name, param.default)
        elif name.endswith("_ptr"):
            signature[name] = POINTERS[name]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=values), target=TARGET)


def variants() -> list[tuple[str, object, dict, tuple[str, ...]]]:
    """(label, kernel, constexprs, pointers) of every variant compiled."""
    from kernels.jit.centroid import centroid_cut_kernel, centroid_decode_lookup_kernel, centroid_score_kernel
    from kernels.jit.compact import expand_groups_kernel, group_block_sums_kernel

    lookup = dict(D=128, BLOCK_D=128, BLOCK_M=16, BLOCK_C=128, SCORE_M=16, SCORE_C=128, BLOCK_SPLIT=16,
                  DOT_PRECISION="tf32", SCALED=True, CODES16=True, HAS_STARTS=True, PDL=True)
    expansion = ("indptr_ptr", "out_ptr", "fixed_ptr", "fixed_on_ptr")
    out = [("cut", centroid_cut_kernel, dict(BLOCK_C=128, PDL=True), ()),
           ("cut among", centroid_cut_kernel, dict(BLOCK_C=128, AMONG=True, HAS_STARTS=False, PDL=True), ()),
           ("cut among, its block sums", centroid_cut_kernel, dict(BLOCK_C=256, AMONG=True, PDL=True), ()),
           ("block sums", group_block_sums_kernel, dict(BLOCK_G=256, PDL=True), ()),
           ("expansion", expand_groups_kernel, dict(BLOCK_G=128, BLOCK_K=8, SUB=128, RCHUNK=1, BLOCK_NB=64,
                                                    BLOCK_T=64, HAS_FIXED=True, PDL=True), ())]
    for label, extra, pointers in (
            ("one launch, threshold", {}, ()),
            ("one launch, cut", dict(HAS_HIST=True, HAS_LISTED=True), ()),
            ("one launch, cut here", dict(HAS_HIST=True, CUT_HERE=True, AHEAD=True), ()),
            ("one launch, whole lookup", dict(HAS_HIST=True, CUT_HERE=True, EXPAND_HERE=True, EXP_BLOCK_NB=64,
                                              EXP_FIXED=True, HIST_FIXED=True), expansion),
            ("one launch, whole lookup at a threshold", dict(EXPAND_HERE=True, EXP_BLOCK_NB=64), expansion)):
        out.append((label, centroid_decode_lookup_kernel, dict(lookup, **extra), pointers))
    score = dict(D=128, BLOCK_D=128, BLOCK_M=16, BLOCK_C=128, BLOCK_SPLIT=16, HAS_ALLOWED=False, LOAD_S=True,
                 HAS_STARTS=True, DOT_PRECISION="tf32", SCALED=True, CODES16=True, HAS_VALID=False, PDL=True)
    out += [("score pass, cut", centroid_score_kernel, dict(score, USE_LIST=False, HAS_HIST=True), ()),
            ("score pass, a list's cut", centroid_score_kernel,
             dict(score, USE_LIST=True, HAS_STARTS=False, HAS_HIST=True, HAS_ELEMENTS=True, READ_KEYS=True), ())]
    return out


def compile_launch(v: dict) -> None:
    """A variant tests/kernels/launches.py recorded, compiled for TARGET as a GPU launches it (with PDL where the
    kernel takes it: the interpreter's launches have it off)."""
    module = importlib.import_module(v["module"])
    kernel = getattr(module, v["name"])
    names = list(v["signature"])
    constexprs = dict(v["constexprs"], **({"PDL": True} if "PDL" in v["constexprs"] else {}))
    values = {(names.index(name),): value for name, value in constexprs.items()}
    triton.compile(ASTSource(fn=kernel, signature=v["signature"], constexprs=values), target=TARGET)


def recorded(paths: list[str]) -> list[tuple[str, dict]]:
    """The distinct variants of the record files (label, variant)."""
    seen: dict[str, dict] = {}
    for path in paths:
        for v in json.loads(Path(path).read_text()):
            seen.setdefault(json.dumps(v, sort_keys=True), v)
    return [(f"{v['name']} {json.dumps(v['constexprs'], sort_keys=True)}", v) for v in seen.values()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.kernels.compile_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", nargs="*", default=None,
                        help="record files of a test run (SQUEEZE_KERNEL_LAUNCHES, tests/conftest.py): compile every "
                             "variant they hold instead of the listed ones")
    parser.add_argument("--ptx", metavar="LABEL", help="print the PTX of the listed variant of this label instead")
    args = parser.parse_args(argv)
    if args.ptx is not None:
        found = [(k, c, p) for label, k, c, p in variants() if label == args.ptx]
        if not found:
            parser.error(f"no listed variant is labelled {args.ptx!r}: {[v[0] for v in variants()]}")
        print(compile_variant(*found[0]).asm["ptx"])
        return 0
    if args.launches is not None:
        jobs = [(label, lambda v=v: compile_launch(v)) for label, v in recorded(args.launches)]
    else:
        jobs = [(label, lambda k=k, c=c, p=p: compile_variant(k, c, p)) for label, k, c, p in variants()]
    failed = 0
    for label, job in jobs:
        try:
            job()
        except Exception as exc:  # noqa: BLE001 (the compiler's errors have many types)
            print(f"FAILED {label}: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed += 1
            continue
        print(f"compiled {label}")
    print(f"{len(jobs) - failed} of {len(jobs)} compiled", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
