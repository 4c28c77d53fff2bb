#!/usr/bin/env python3
"""Lane-order audit of the SIMD kernels (docs/architecture.md, "Lane order at every vector width").

A kernel runs in the tests only on the SIMD targets of the processor that runs them, so a
lane-order mistake that shows only on 512-bit vectors passes on an AVX2 machine. This check keeps
the kernels to operations whose result does not depend on the vector width:

- a block-local Highway operation (it works within each 128-bit block) in src/kernels/ fails;
- every lane-moving, width-changing or reducing operation a kernel uses must have a row for that
  file in the architecture table (which says why it is right at 128, 256 and 512 bits), and
  every row must name an operation the file still uses.

Usage: simd_lane_order_audit.py REPO_ROOT   (exit 0: clean; 1: findings, listed one per line)
"""
import pathlib
import re
import sys

# Highway operations that act within each 128-bit block: right only while a vector is one block.
BLOCK_LOCAL = {
    "InterleaveLower", "InterleaveUpper", "ZipLower", "ZipUpper", "Shuffle01", "Shuffle0123",
    "Shuffle1032", "Shuffle0321", "Shuffle2103", "Shuffle2301", "Broadcast", "TableLookupBytes",
    "TableLookupBytesOr0", "ShiftLeftBytes", "ShiftRightBytes", "ShiftLeftLanes",
    "ShiftRightLanes", "CombineShiftRightBytes", "CombineShiftRightLanes", "ReorderDemote2To",
    "ReorderWidenMulAccumulate", "OddEvenBlocks", "SwapAdjacentBlocks", "LoadDup128",
    "Per4LaneBlockShuffle",
}
# Whole-vector operations that move lanes, change the lane count or reduce: each use is listed.
LISTED = {
    "PromoteTo", "DemoteTo", "OrderedDemote2To", "LowerHalf", "UpperHalf", "Combine",
    "ZeroExtendVector", "ConcatEven", "ConcatOdd", "ConcatLowerLower", "ConcatUpperUpper",
    "Reverse", "Reverse2", "Reverse4", "Reverse8", "TableLookupLanes", "IndicesFromVec",
    "SetTableIndices", "Compress", "CompressStore", "CompressBlendedStore", "CompressBits",
    "Expand", "GatherIndex", "GatherOffset", "ScatterIndex", "ScatterOffset", "SumOfLanes",
    "MaxOfLanes", "MinOfLanes", "ReduceSum", "StoreMaskBits", "LoadMaskBits", "SlideUpLanes",
    "SlideDownLanes", "LoadInterleaved2", "LoadInterleaved3", "LoadInterleaved4",
    "StoreInterleaved2", "StoreInterleaved3", "StoreInterleaved4", "WidenMulPairwiseAdd",
    "PromoteLowerTo", "PromoteUpperTo", "InterleaveWholeLower", "InterleaveWholeUpper",
    "ConcatLowerUpper", "ConcatUpperLower", "DupEven", "DupOdd", "OddEven", "InterleaveEven",
    "InterleaveOdd", "MulEven", "MulOdd", "SumsOf8",
}
# x86 intrinsics that move lanes (fixed-width code): each use is listed too.
INTRINSIC = re.compile(
    r"\b(_mm(?:256|512)?_(?:shuffle|unpack|permute|extract|insert|broadcast|alignr|dpbf16|"
    r"blend|movehdup|moveldup|cvt)[a-z0-9_]*)\b")
HWY_OP = re.compile(r"\bhn::([A-Z][A-Za-z0-9]*)\b")
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*`([^`]+)`\s*\|")


def main(root: pathlib.Path) -> int:
    doc = (root / "docs" / "architecture.md").read_text(encoding="utf-8")
    start = doc.find("### Lane order at every vector width")
    if start < 0:
        print("docs/architecture.md: no section 'Lane order at every vector width'")
        return 1
    end = doc.find("\n#", start + 1)
    listed = set()
    for line in doc[start:end if end > 0 else len(doc)].splitlines():
        m = ROW.match(line)
        if m and m.group(1) != "kernel":
            listed.add((m.group(1), m.group(2)))

    used = set()
    problems = []
    # Every file under src/kernels/, terms/ included, named by its path below it.
    kernels = sorted((root / "src" / "kernels").rglob("*"))
    if not kernels:
        print("src/kernels/: no files")
        return 1
    for path in kernels:
        if path.suffix not in (".cc", ".h"):
            continue
        name = path.relative_to(root / "src" / "kernels").as_posix()
        text = path.read_text(encoding="utf-8")
        # Comments name operations too (to say why one is avoided): only code counts.
        code = re.sub(r"//[^\n]*", "", text)
        for lineno, line in enumerate(code.splitlines(), 1):
            for op in HWY_OP.findall(line):
                if op in BLOCK_LOCAL:
                    problems.append(f"src/kernels/{name}:{lineno}: hn::{op} is block-local "
                                    "(its lane order depends on the vector width)")
                elif op in LISTED:
                    used.add((name, op))
            for op in INTRINSIC.findall(line):
                used.add((name, op))
    for name, op in sorted(used - listed):
        problems.append(f"src/kernels/{name}: {op} is used but not listed in docs/architecture.md "
                        "(Lane order at every vector width)")
    for name, op in sorted(listed - used):
        problems.append(f"docs/architecture.md: the lane-order table lists {op} in {name}, "
                        "which does not use it")
    for p in problems:
        print(p)
    print(f"lane-order audit: {len(used)} operation uses listed, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
