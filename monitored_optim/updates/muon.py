"""Muon view (``torch/optim/_muon.py``, torch 2.13).

torch's Muon (2-D parameters only; no ``maximize``, no foreach), with momentum μ, weight decay λ,
s = 1 - lr·λ, and A×B the parameter's shape:

    B ← lerp(B, g, 1-μ)                        (an EMA; the docstring's B = μB + g is not the code)
    X = lerp(g, B, μ) (nesterov) or B;   O = NS_k^{(a,b,c)}(X; eps)   (Newton–Schulz in bfloat16)
    lr' = lr·sqrt(max(1, A/B)) ("original", default) or 0.2·lr·sqrt(max(A, B)) ("match_rms_adamw")
    p_a = s·p_b - lr'·O

Rebuild after the step: X is rebuilt from the grad and the stored buffer B, O by running torch's own
``_zeropower_via_newtonschulz`` on it again (same inputs, same bfloat16 kernels: bit-identical on
CPU; on GPU it relies on deterministic GEMMs), d = -lr'·O and, under weight decay, ``Stores((d,), s)`` (u = d when
λ = 0). Cost on a logging step: 3·ns_steps matmuls per parameter (15 by default), no clone.
A Tensor lr makes lr' and s float32 tensor arithmetic, as in torch.
Source: Jordan et al. (2024) "Muon: An optimizer for hidden layers in neural networks", Liu et al.
(2025) "Muon is Scalable for LLM Training", ``torch/optim/_muon.py`` (``_single_tensor_muon``) and
``docs/update-formulas.md`` §Muon.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .clone import Stores
from .view import View

try:  # torch's own Newton–Schulz and lr adjustment (torch >= 2.9 ships Muon)
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
except ImportError:  # pragma: no cover - older torch: no Muon class, so the view is never registered
    _adjust_lr = _zeropower_via_newtonschulz = None  # type: ignore[assignment]


class MuonView(View):
    """State-aware view for ``torch.optim.Muon`` (formulas in the module docstring)."""

    def before(self, group: dict[str, Any], p: Tensor, state: dict[str, Any]) -> None:
        return None

    def update(self, group: dict[str, Any], p: Tensor, state: dict[str, Any], snapshot: Any) -> Tensor | Stores | None:
        if p.grad is None or "momentum_buffer" not in state:
            return None
        grad, buf = p.grad, state["momentum_buffer"]
        x = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        ortho = _zeropower_via_newtonschulz(x, group["ns_coefficients"], group["ns_steps"], group["eps"])
        lr = group["lr"]
        if isinstance(lr, Tensor) and lr.dim() != 0:
            lr = lr.squeeze()
        u = ortho.to(p.dtype).mul_(-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        wd = group["weight_decay"]
        return Stores((u,), 1 - lr * wd) if wd != 0 else u
