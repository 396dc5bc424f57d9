"""The plan of a logging step (``monitored_optim.capture.plan``): kept while the parameters stay the same,
rebuilt when anything it is derived from changes, with the clone truth's figures at every step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import truth
from monitored_optim import Monitored, MonitorConfig


def _params(gen: torch.Generator) -> list[tuple[str, nn.Parameter]]:
    """Small parameters (captured flat) and a matrix above the flat limit (4,096 elements)."""
    return [("w", nn.Parameter(torch.randn(80, 80, generator=gen))), ("b", nn.Parameter(torch.zeros(80))),
            ("g", nn.Parameter(torch.ones(80))), ("v", nn.Parameter(torch.randn(30, 20, generator=gen)))]


def _logged_step(opt: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]], gen: torch.Generator,
                 no_grad: tuple[str, ...] = ()) -> None:
    """Fresh grads (none for ``no_grad``), one step, and its figures against the clone truth of ``named``."""
    for name, p in named:
        p.grad = None if name in no_grad else torch.randn(p.shape, generator=gen, dtype=p.dtype)
        if "sparse" in no_grad and p.dim() == 1:
            p.grad = p.grad.to_sparse()
    before, grads = truth.snapshot(named)
    opt.step()
    truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, grads))


def _drop_grad(opt, named, gen, chosen):
    return named, ("b",)


def _to_float64(opt, named, gen, chosen):
    for _, p in named:
        if p.numel() < 4096:
            p.data = p.data.double()
    return named, ()


def _reshape(opt, named, gen, chosen):
    named[1][1].data = torch.zeros(40)
    return named, ()


def _new_storage(opt, named, gen, chosen):
    for _, p in named:
        p.data = p.data.clone() + 1.0
    return named, ()


def _transposed(opt, named, gen, chosen):
    v = named[3][1]
    v.data = torch.randn(20, 30, generator=gen).t()  # same shape, not contiguous: no longer captured flat
    return named, ()


def _add_group(opt, named, gen, chosen):
    extra = nn.Parameter(torch.randn(50, generator=gen))
    opt.add_param_group({"params": [extra], "param_names": ["extra"], "lr": 1e-3})
    chosen.add("extra")
    return named + [("extra", extra)], ()


def _select_fewer(opt, named, gen, chosen):
    chosen.discard("g")
    return [(n, p) for n, p in named if n != "g"], ()


def _sparse_grad(opt, named, gen, chosen):
    return named, ("sparse",)


CHANGES = {"float64 data": (_to_float64, True), "new shape": (_reshape, True), "new storage": (_new_storage, True),
           "not contiguous": (_transposed, True), "a param group added": (_add_group, True),
           "a callable selection": (_select_fewer, True), "a grad dropped": (_drop_grad, False),
           "a sparse grad": (_sparse_grad, False)}


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_layout_is_kept_while_the_parameters_stay_the_same_and_rebuilt_when_they_change(change, tmp_path):
    """Two logging steps with the same parameters share one layout; after ``change`` the next logging
    step builds a new one where the change is an input of the layout (a dtype, shape or storage set
    through ``.data``, a param group, what a ``params=`` callable selects) and keeps it where it is not (a
    grad dropped, or sparse: a parameter captured flat needs none, a dense one); every step's figures
    are the clone truth's (plain SGD: no state, so the parameters may change under it)."""
    gen = torch.Generator().manual_seed(0)
    named = _params(gen)
    chosen = {n for n, _ in named}
    opt = Monitored(torch.optim.SGD)(named, lr=1e-2, monitor=MonitorConfig(
        backend="none", logdir=tmp_path, params=lambda name, p: name in chosen))
    _logged_step(opt, named, gen)
    first = opt.monitor._engine.capture.plan
    _logged_step(opt, named, gen)
    assert opt.monitor._engine.capture.plan is first
    change, rebuilt = CHANGES[change]
    named, no_grad = change(opt, named, gen, chosen)
    _logged_step(opt, named, gen, no_grad)
    assert (opt.monitor._engine.capture.plan is not first) == rebuilt
    kept = opt.monitor._engine.capture.plan
    _logged_step(opt, named, gen, no_grad)
    assert opt.monitor._engine.capture.plan is kept


def test_names_given_by_watch_after_the_first_logging_step_rebuild_the_layout(tmp_path):
    """Unnamed parameters are logged as ``param{k}`` until ``watch(model)`` names them; the logging step
    after it logs them by their model names."""
    model = nn.Sequential(nn.Linear(6, 4), nn.LayerNorm(4))
    with pytest.warns(UserWarning, match="parameters have no names"):
        opt = Monitored(torch.optim.SGD)(model.parameters(), lr=1e-2, monitor=MonitorConfig(backend="none",
                                                                                         logdir=tmp_path))
    gen = torch.Generator().manual_seed(0)
    unnamed = [(f"param{k}", p) for k, p in enumerate(model.parameters())]
    _logged_step(opt, unnamed, gen)
    opt.monitor.watch(model)
    _logged_step(opt, list(model.named_parameters()), gen)
    assert "update_norm/1.weight" in opt.monitor.latest


def test_closure_and_plain_steps_that_share_a_layout_each_log_their_own_grads(tmp_path):
    """SGD with Nesterov momentum and ``foreach`` rewrites ``p.grad`` in its step, so no fused capture
    runs and a step with a closure and one without share a layout; the closure's grads get slots of
    their own, and each step's figures (grads included) are the clone truth's, with no error."""
    gen = torch.Generator().manual_seed(0)
    # "b": a gain at 1.0
    named = [("b", nn.Parameter(torch.ones(100))), ("w", nn.Parameter(torch.randn(80, 80, generator=gen)))]
    opt = Monitored(torch.optim.SGD)(named, lr=0.1, momentum=0.9, nesterov=True, foreach=True,
                                     monitor=MonitorConfig(backend="none", logdir=tmp_path))
    for step in range(4):
        grads = [torch.randn(p.shape, generator=gen) for _, p in named]
        before, _ = truth.snapshot(named)

        def closure(grads=grads):  # called in this iteration: bound to its grads
            for (_, p), g in zip(named, grads):
                p.grad = g.clone()
            return torch.tensor(0.0)

        if step % 2:
            closure()
            opt.step()
        else:
            opt.step(closure)
        truth.assert_figures_match(opt.monitor.latest, truth.figures(named, before, dict(zip(["b", "w"], grads))))


def test_storage_shared_with_a_parameter_left_out_of_the_selection_is_still_snapshotted(tmp_path):
    """A monitored matrix whose first row is another parameter that ``params=`` leaves out: both are
    stepped in one storage, so the matrix's update is the stored change, not its own rebuilt one."""
    gen = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(80, 80, generator=gen))
    row = nn.Parameter(w.data[0])
    opt = Monitored(torch.optim.Adam)([("w", w), ("row", row)], lr=1e-2, monitor=MonitorConfig(
        backend="none", logdir=tmp_path, params=lambda name, p: name == "w"))
    for _ in range(3):
        row.grad = torch.randn(80, generator=gen)
        w.grad = torch.randn(80, 80, generator=gen)
        before, grads = truth.snapshot([("w", w)])
        opt.step()
        truth.assert_figures_match(opt.monitor.latest, truth.figures([("w", w)], before, grads))


def test_param_names_edited_in_place_rename_the_figures(tmp_path):
    """A param group's ``param_names`` list changed in place: the next logging step logs the new name."""
    gen = torch.Generator().manual_seed(0)
    named = _params(gen)
    opt = Monitored(torch.optim.SGD)(named, lr=1e-2, monitor=MonitorConfig(backend="none", logdir=tmp_path))
    _logged_step(opt, named, gen)
    opt.param_groups[0]["param_names"][1] = "bias"
    named[1] = ("bias", named[1][1])
    _logged_step(opt, named, gen)
    assert "update_norm/bias" in opt.monitor.latest and "update_norm/b" not in opt.monitor.latest


def test_close_lets_go_of_parameters_the_optimizer_no_longer_holds(tmp_path):
    """The layout holds the parameters of its last logging step; after they leave the optimizer,
    ``opt.monitor.close()`` frees them."""
    import gc
    import weakref

    gen = torch.Generator().manual_seed(0)
    named = _params(gen)
    opt = Monitored(torch.optim.SGD)(named, lr=1e-2, monitor=MonitorConfig(backend="none", logdir=tmp_path))
    _logged_step(opt, named, gen)
    held = weakref.ref(named[0][1])
    opt.param_groups.clear()
    del named
    gc.collect()
    assert held() is not None  # the layout's until a logging step builds another
    opt.monitor.close()
    gc.collect()
    assert held() is None



def test_a_group_whose_tensors_an_engine_replaced_is_not_logged_under_their_names():
    """An optimizer wrapper the monitor does not know replaces a group's parameters with one flat
    buffer and keeps its ``param_names``: the buffer's figures are logged as ``param0``, never under
    a parameter's name, and one warning says why."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = Monitored(torch.optim.AdamW)(net.named_parameters(), lr=0.1, monitor=MonitorConfig(backend="none", every=1))
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    opt.param_groups[0]["params"] = [flat]
    flat.grad = torch.ones_like(flat)
    with pytest.warns(RuntimeWarning, match="cannot map back to the named parameters") as seen:
        opt.step()
        opt.step()
    assert len([w for w in seen if "monitored_optim" in str(w.message)]) == 1
    assert {t.split("/", 1)[1] for t in opt.monitor.latest if t.startswith("update_norm/")} == {"param0"}
