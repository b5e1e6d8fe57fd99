"""Per-token absmax quantization, written plainly: the scale is a reduction over the row and
the quantized values need it, a cascaded reduction. acefuse carries the running absmax as the
one state; the quantized row is an epilogue of the same kernel, so a row that fits one tile
(the common case: 8192 channels) is read from memory once, writing ``q`` and ``scale``.

    acefuse derive examples/quant.py
    acefuse run examples/quant.py --check

Conventions (README, "Quantization"): ``af.cast`` rounds to nearest even, bit-exact with
torch's ``.to()`` (float8_e4m3fn saturates at +-448, as torch); an all-zero row has scale 0
and ``q`` 0 (0/0 from a reduction is 0), where torch's ``x / 0`` would give NaN.
"""
import acefuse as af

x = af.tensor("x", "t h")             # tokens t, channels h (the reduced axis)

# float8 e4m3: the largest finite value is 448
absmax = af.max(af.abs(x), "h")
scale = af.cast(absmax / 448.0, "float32")   # a float32 output whatever the input's dtype
quant_fp8 = af.program("quant_fp8", q=af.cast(x / scale, "float8_e4m3fn"), scale=scale)

# float8 e5m2 (largest finite 57344): gradients and activations with a wider range
scale5 = af.cast(absmax / 57344.0, "float32")
quant_e5m2 = af.program("quant_e5m2", q=af.cast(x / scale5, "float8_e5m2"), scale=scale5)

# int8, symmetric: scale = absmax / 127, round to nearest even, clamp, cast
scale8 = af.cast(absmax / 127.0, "float32")
quant_int8 = af.program("quant_int8", q=af.cast(af.clamp(af.round(x / scale8), -127, 127), "int8"),
                        scale=scale8)

# the quantization error of a row: not fusible, and acefuse says why (the error of an element
# depends on the row's final scale, inside a max: a second pass over the row)
err = af.max(af.abs(af.cast(x / scale, "float8_e4m3fn") * scale - x), "h")
quant_fp8_error = af.program("quant_fp8_error", scale=scale, err=err)

# per-token quantization feeding a GEMM (a linear layer in float8): x quantized per token as
# above, a weight wq [n, h] already in float8 with its per-channel scale ws. af.gemm reads the
# program as out = epilogue(sum_h A * B) with A = cast(x / scale, e4m3), B = wq, and generates
# either the quantization kernel above followed by torch._scaled_mm, or one Triton GEMM that
# quantizes A's tiles in its prologue (q never written); on a GPU the first call for a shape
# times both and keeps the faster, on the CPU a cost model in bytes picks one
# (g.explain(**inputs) says which and why: the model's bytes, and the measured times)
wq = af.tensor("wq", "n h")
ws = af.tensor("ws", "n")
fp8_linear = af.program("fp8_linear", out=af.sum(af.cast(x / scale, "float8_e4m3fn") * wq, "h") * scale * ws)


if __name__ == "__main__":
    import torch
    for prog in (quant_fp8, quant_int8):
        f = af.fuse(prog)
        print(f.explain())
        k = af.compile(prog)
        xv = torch.randn(4, 8192)
        out = k(x=xv)
        ref = (xv / out["scale"][:, None])
        ref = ref.to(torch.float8_e4m3fn) if prog is quant_fp8 else ref.round().clamp(-127, 127).to(torch.int8)
        same = (out["q"].view(torch.uint8) == ref.view(torch.uint8)).float().mean().item()
        print(f"{prog.name}: q {out['q'].dtype}, scale {out['scale'].dtype}; equal to torch's cast of "
              f"x / scale: {same:.2%} of elements")

    # the GEMM: both forms on odd sizes, against a float64 matmul of the dequantized values
    g = af.gemm(fp8_linear)
    xv = torch.randn(37, 80, dtype=torch.bfloat16)
    w = torch.randn(48, 80)
    wsv = (w.abs().amax(1).double() / 448.0).float()
    wqv = (w / wsv[:, None]).to(torch.float8_e4m3fn)
    print(g.explain(x=xv, wq=wqv, ws=wsv))
    sv = (xv.double().abs().amax(1) / 448.0).float()
    ref = ((xv.float() / sv[:, None]).to(torch.float8_e4m3fn).double() @ wqv.double().t()) * sv.double()[:, None] \
        * wsv.double()[None, :]
    for form in ("scaled_mm", "prologue"):
        out = g(form=form, out_dtype=torch.float32, x=xv, wq=wqv, ws=wsv)["out"]
        print(f"fp8_linear, {form} ({g.last_path}): max relative difference to float64 "
              f"{((out.double() - ref).abs().max() / ref.abs().max()).item():.1e}")
