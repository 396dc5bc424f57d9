"""A logging step's flow runs downward: no function of the package calls into a module that is already
on the call stack below it (a callback up into the monitor, a helper reaching back into its caller).

The calls are traced with ``sys.setprofile`` over one warmed-up logging step. The timing decorator's
wrapper (``capture.spent.timed``'s ``run``, which calls the stage it wraps) and resumed generators (a
generator made in one module and consumed in another: data passed down, not a call up) are not
frames of their own here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest
import torch

import monitored_optim
from monitored_optim import Monitored, MonitorConfig

ROOT = os.path.dirname(monitored_optim.__file__) + os.sep
GENERATOR = 0x20  # inspect.CO_GENERATOR


def module_of(code) -> str | None:
    """The package module that ``code`` belongs to (``capture.eager``), None outside the package, for
    the timing wrapper and for a resumed generator."""
    if not code.co_filename.startswith(ROOT) or code.co_flags & GENERATOR:
        return None
    name = code.co_filename[len(ROOT):].removesuffix(".py").replace(os.sep, ".")
    return None if (name, code.co_name) == ("capture.spent", "run") else name


def climbs(step: Callable[[], None]) -> tuple[list[str], set[str]]:
    """The calls of ``step()`` from one package module into another module already on the stack
    (``"caller.function -> callee.function"``), and every package module it entered."""
    stack: list[tuple[str, str] | None] = []
    found, entered = [], set()

    def profile(frame, event, arg):
        if event == "call":
            module = module_of(frame.f_code)
            if module is not None:
                below = [s for s in stack if s is not None]
                if below and below[-1][0] != module and module in {m for m, _ in below}:
                    found.append(f"{'.'.join(below[-1])} -> {module}.{frame.f_code.co_name}")
                entered.add(module)
                stack.append((module, frame.f_code.co_name))
            else:
                stack.append(None)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return found, entered


@pytest.mark.parametrize("figures", ["default", "all"])
@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.SGD])
def test_a_logging_step_never_calls_back_up(optimizer, figures):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = Monitored(optimizer)(model.named_parameters(), lr=1e-3, monitor=MonitorConfig(
        backend="none", every=1, figures=figures))

    def step():
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()

    for _ in range(3):  # the layout found and the plans kept: the step as it runs from then on
        step()
    found, entered = climbs(step)
    assert found == []
    assert {"engine", "flow", "capture.__init__", "reduce", "figures", "deliver"} <= entered  # the walk saw the step
