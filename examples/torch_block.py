"""A small transformer block through torch.compile with acefuse as the backend: the
layernorms and the masked softmax run as acefuse kernels, the matmuls stay in torch.

Inference (under torch.no_grad()) runs the plain kernels; a training step runs them as
differentiable kernels (forward: augmented kernel; backward: the kernels of
af.backward of each region's program), and every parameter's gradient matches eager.

    python examples/torch_block.py
"""
import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import acefuse.frontend as aff


class Block(nn.Module):
    def __init__(self, C=16, H=2):
        super().__init__()
        self.H = H
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fc2 = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, N, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.tril(torch.ones(N, N, dtype=torch.bool))
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, N, C)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


def main():
    torch.manual_seed(0)
    m = Block().eval()
    x = torch.randn(2, 5, 16)
    cm = torch.compile(m, backend=aff.backend, dynamic=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        err = (cm(x) - m(x)).abs().max().item()
    print(f"max |acefuse - eager| = {err:.2e}")
    assert err < 1e-4

    m.train()                                     # a training step: gradients through the kernels
    w = torch.randn(2, 5, 16)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        (cm(x) * w).sum().backward()
    fell_back = [str(r.message) for r in rec if "runs in torch" in str(r.message)]
    assert not fell_back, fell_back               # every region ran forward and backward in acefuse
    got = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    (m(x) * w).sum().backward()
    gerr = max(((got[n] - p.grad).abs().max() / (1 + p.grad.abs().max())).item() for n, p in m.named_parameters())
    print(f"max gradient error over {len(got)} parameters = {gerr:.2e}")
    assert gerr < 1e-4


main()
