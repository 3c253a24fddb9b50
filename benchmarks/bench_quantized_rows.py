"""Which kernel a compact layer should use at each input row count: CPU ms of one SmolLM2-135M decoder layer's four
projections (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536), one thread, through

- the int4 op (`aten._weight_int4pack_mm_for_cpu`, bfloat16 activations),
- int8 activations, two passes a row, on the native kernel where it builds (`native_int8`), else on fbgemm's u8s8
  kernel (`quantized_linear.int8_rows_matmul`; where `INT8_ACTIVATIONS`),
- the int8 weight-only op (`aten._weight_int8pack_mm`, bfloat16 activations),
- a dense matmul with the int4 layer's dense copy of its weight, in bfloat16 and in float32.

`kvprefix.model.quantized_linear` takes its choices from this: the weight-only ops up to `dense_above_rows` and a
dense matmul with the kept copy above, in bfloat16 where it is native (AVX512-BF16, AMX), else in float32; int8
layers on the int8-activation kernel at every row count where it is exact.

    python benchmarks/bench_quantized_rows.py [--rows 1,8,32,128,512] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvprefix.model.loader import native_bfloat16_cpu
from kvprefix.model.quantized_linear import INT8_ACTIVATIONS, Int4Linear, Int8Linear

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of a layer's stacked projections


def cpu_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - start) / repeats * 1e3


def kernels(w: torch.Tensor) -> dict:
    """name -> a function of the input rows, one per kernel (the layers forced onto it whatever the row count)."""
    int4 = Int4Linear.from_float(w)
    int4.dense_above_rows = 1 << 30
    weight_only = Int8Linear.from_float(w, int8_activations=False)
    weight_only.dense_above_rows = 1 << 30
    out = {"int4 op": int4}
    if INT8_ACTIVATIONS:
        out["int8 activations"] = Int8Linear.from_float(w, int8_activations=True)
    out["int8 weight-only op"] = weight_only
    for dtype in (torch.bfloat16, torch.float32):  # the copy as the layer keeps it on a CPU of that dtype
        copy = int4.dequantize().to(dtype)
        out[f"dense copy {str(dtype).removeprefix('torch.')}"] = lambda x, dtype=dtype, copy=copy: x.to(dtype) @ copy.t()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,128,512")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}; native bfloat16 matmuls: "
          f"{native_bfloat16_cpu()}; exact int8 activations (INT8_ACTIVATIONS): {INT8_ACTIVATIONS}; CPU ms per "
          "layer's projections, 1 thread\n")
    gen = torch.Generator().manual_seed(0)
    layers = [kernels(torch.randn(o, i, generator=gen)) for o, i in SHAPES]
    names = list(layers[0])
    print("| rows | " + " | ".join(names) + " |")
    print("|" + "---|" * (len(names) + 1))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, i, generator=gen, dtype=torch.bfloat16) for _, i in SHAPES]
        cells = [sum(cpu_ms(lambda f=layer[n], x=x: f(x), args.repeats) for layer, x in zip(layers, xs, strict=True))
                 for n in names]
        print(f"| {rows} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
