"""Where a quantized layer should stop using the weight-only op and dequantize: per input row count, the int8/int4
op (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`) against dequantizing the weight and a dense
matmul in bfloat16 and in float32, for SmolLM2-135M's two projection shapes, in CPU time of one thread.

The crossovers depend on the CPU: where bfloat16 matmuls are native (AVX512-BF16, AMX) the bfloat16 path wins early;
where they are emulated (AVX2 only) bfloat16 is the slowest and float32 takes over much later.
`kvprefix.model.quantized_linear` picks the dense dtype by that probe (`dense_above_rows` is one value: the crossovers
fell near it on both kinds); this script is how they were chosen.

    python benchmarks/bench_quantized_rows.py [--rows 1,8,32,64,128,256,512] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvprefix.model import quantized_linear
from kvprefix.model.loader import native_bfloat16_cpu
from kvprefix.model.quantized_linear import Int4Linear, Int8Linear


def cpu_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - start) / repeats * 1e3


def layer_dequantized(layer, dtype: torch.dtype) -> torch.Tensor:
    """The layer's dequantized weight as its dense path would build it in ``dtype`` (whatever this CPU's is)."""
    saved = quantized_linear._DENSE
    quantized_linear._DENSE = dtype
    try:
        return layer.dequantize()
    finally:
        quantized_linear._DENSE = saved


def row_costs(layer, x: torch.Tensor, repeats: int) -> list[float]:
    """CPU ms of ``layer``'s op, then of its dequantized path in bfloat16 and in float32, on input ``x``."""
    layer.dense_above_rows = 1 << 30  # the op, whatever the row count
    costs = [cpu_ms(lambda: layer(x), repeats)]
    for dtype in (torch.bfloat16, torch.float32):
        costs.append(cpu_ms(lambda dtype=dtype: x.to(dtype) @ layer_dequantized(layer, dtype).t(), repeats))
    return costs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,64,128,256,512")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"native bfloat16 matmuls: {native_bfloat16_cpu()}; layers dequantize above "
          f"{Int8Linear.dense_above_rows} (int8) / {Int4Linear.dense_above_rows} (int4) rows in "
          f"{quantized_linear._DENSE}; CPU ms per call, 1 thread\n")
    print("| shape | rows | int8 op | int8 dequantized bf16 | int8 dequantized f32 | int4 op "
          "| int4 dequantized bf16 | int4 dequantized f32 |")
    print("|" + "---|" * 8)
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features in ((1536, 576), (576, 1536)):
        w = torch.randn(out_features, in_features, generator=gen)
        layers = {"int8": Int8Linear.from_float(w), "int4": Int4Linear.from_float(w)}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_features, generator=gen, dtype=torch.bfloat16)
            cells = [c for layer in layers.values() for c in row_costs(layer, x, args.repeats)]
            print(f"| {out_features}x{in_features} | {rows} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
