"""Clone-and-diff truth for the tests: the figures a careful user computes by hand around step().

Independent of the library: clones every parameter and gradient before ``step()``, diffs after,
and computes stds (correction=1) and L2 norms in float64 with plain torch calls.
"""

from __future__ import annotations

import math

from torch import Tensor


def snapshot(named: list[tuple[str, Tensor]]) -> tuple[dict[str, Tensor], dict[str, Tensor | None]]:
    """Clones of every parameter and of its dense gradient (``None`` where there is no grad)."""
    params = {n: p.detach().clone() for n, p in named}
    grads = {n: None if p.grad is None else
             (p.grad.coalesce().to_dense() if p.grad.is_sparse else p.grad).detach().clone()
             for n, p in named}
    return params, grads


def figures(named: list[tuple[str, Tensor]], before: dict[str, Tensor],
            grads: dict[str, Tensor | None], silent: bool = False) -> dict[str, float]:
    """Expected per-parameter and global figures after the step, from the clones taken before it;
    ``silent``: the step left every parameter unchanged by the optimizer's design (a silent warm-up
    phase), so none counts as unchanged."""
    out: dict[str, float] = {"health/no_grad": 0.0, "health/unchanged": 0.0, "health/nonfinite": 0.0,
                             "health/skipped_steps": 0.0, "health/withheld": 0.0}
    total = {"param": 0.0, "grad": 0.0, "update": 0.0}
    for name, p in named:
        p_b = before[name].double()
        u = p.detach().double() - before[name].double()
        out[f"param_norm/{name}"] = p_b.norm().item()
        out[f"update_norm/{name}"] = u.norm().item()
        _ratio(out, f"update_to_data/{name}", u, p_b)
        total["param"] += p_b.norm().item() ** 2
        total["update"] += u.norm().item() ** 2
        out["health/no_grad"] += grads[name] is None
        # an empty parameter cannot change, so it is never counted as unchanged
        out["health/unchanged"] += not silent and grads[name] is not None and u.numel() > 0 and not u.any()
        out["health/nonfinite"] += not all(t is None or bool(t.isfinite().all()) for t in (p_b, grads[name], u))
        if grads[name] is not None:
            g = grads[name].double()
            out[f"grad_norm/{name}"] = g.norm().item()
            _ratio(out, f"grad_to_data/{name}", g, p_b)
            total["grad"] += g.norm().item() ** 2
    out.update({f"global/{k}_norm": math.sqrt(v) for k, v in total.items()})
    return {tag: value for tag, value in out.items() if math.isfinite(value)}  # as the backends get them


def _ratio(out: dict[str, float], tag: str, num: Tensor, den: Tensor) -> None:
    if num.numel() < 2:
        return
    a, b = num.std().item(), den.std().item()
    if a > 0 and b > 0:
        out[tag] = math.log10(a / b)


def assert_figures_match(logged: dict[str, float], expected: dict[str, float],
                         ratio_tol: float = 2e-3, norm_rtol: float = 1e-4) -> None:
    """Same tags (lr/*, health/spikes and the monitor's own cost monitor/*, tested on their own, aside)
    and values within tolerance: log10 ratios absolute, norms relative."""
    got = {k: v for k, v in logged.items() if not k.startswith(("lr/", "monitor/")) and k != "health/spikes"}
    assert set(got) == set(expected), (sorted(set(got) ^ set(expected)))
    for tag, want in expected.items():
        have = got[tag]
        if tag.startswith("health/"):
            assert have == want, (tag, have, want)
        elif "_to_data/" in tag:
            assert abs(have - want) <= ratio_tol, (tag, have, want)
        else:
            assert abs(have - want) <= norm_rtol * abs(want) + 1e-30, (tag, have, want)
