"""The Python side of DiLoCo's layout, without processes: parameters become views into one flat
buffer, and the inner optimizer's state goes into the checkpoint's flat layout and back."""

import pytest
import torch

import lightkeeper
from lightkeeper.diloco import _InnerLayout


def model_and_opt(opt_cls=torch.optim.AdamW, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    return model, opt_cls(model.parameters(), **kw)


def train(model, opt, steps):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 3, generator=gen)).pow(2).mean().backward()
        opt.step()


def test_parameters_become_views_into_one_flat_buffer_with_the_same_values():
    model, opt = model_and_opt()
    before = [p.detach().clone() for p in model.parameters()]
    ids = [id(p) for p in model.parameters()]
    d = lightkeeper.DiLoCo(None, model, opt, sync_every=2)
    d._flatten()
    params = list(model.parameters())
    assert [id(p) for p in params] == ids  # the optimizer's references stay valid
    base = d._flat.data_ptr()
    for p, b in zip(params, before):
        assert torch.equal(p, b)
        assert base <= p.data_ptr() < base + 4 * d._flat.numel()
    assert [s.name for s in d._specs] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [s.offset for s in d._specs] == [0, 15, 20, 30]
    # Writing the flat buffer (what the outer step does) changes the model in place.
    d._flat.fill_(0.5)
    assert all(bool(torch.all(p == 0.5)) for p in params)
    train(model, opt, 2)  # and training still works on the views


def test_adamw_state_layout_matches_the_cpp_trainer_and_round_trips():
    model, opt = model_and_opt(lr=0.01)
    named = list(model.named_parameters())
    layout = _InnerLayout(opt, named)
    names = [s.name for s in layout.specs()]
    assert names[:3] == ["exp_avg/0.weight", "exp_avg_sq/0.weight", "step/0.weight"]
    assert layout.total == sum(2 * p.numel() + 1 for _, p in named)
    assert float(layout.digest(opt).abs().sum()) == 0.0  # no state yet: zeros
    train(model, opt, 3)
    saved = layout.digest(opt)
    assert float(saved.abs().sum()) > 0
    # A fresh optimizer loaded from the flat state continues exactly like the original.
    model2, opt2 = model_and_opt(lr=0.01)
    model2.load_state_dict(model.state_dict())
    layout2 = _InnerLayout(opt2, list(model2.named_parameters()))
    layout2.load(opt2, saved.clone())
    assert torch.equal(layout2.digest(opt2), saved)
    train(model, opt, 2)
    train(model2, opt2, 2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_sgd_momentum_state_is_found_too():
    model, opt = model_and_opt(torch.optim.SGD, lr=0.1, momentum=0.9)
    layout = _InnerLayout(opt, list(model.named_parameters()))
    assert [s.name for s in layout.specs()][0] == "momentum_buffer/0.weight"


def test_non_float32_parameters_are_refused():
    model, opt = model_and_opt()
    model.double()
    d = lightkeeper.DiLoCo(None, model, opt, sync_every=2)
    with pytest.raises(lightkeeper.Error) as e:
        d._flatten()
    assert e.value.code == "invalid_argument"
