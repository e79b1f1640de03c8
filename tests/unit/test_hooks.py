"""The attachment journal (NOTE [attachments] in meshlm/runtime/hooks.py): every way meshlm
changes a module (its class, its own call, forward hooks, attributes) is undone exactly by
``detach``, one owner at a time or all at once; a change beneath another owner's is not
undone; derived classes are named ``<Prefix><UserClass>`` (NOTE [sharded class names]) and
refuse to be pickled.  ``meshlm.shard`` itself, with scopes, activation checkpointing and
compiled blocks, is detached back to the user's classes, hooks and attributes on a fake
process group."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import meshlm
from harness.simworld import fake_mesh
from meshlm.runtime import hooks

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


@pytest.fixture(autouse=True)
def fake_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def snapshot(m: nn.Module) -> dict:
    """What ``detach`` must restore: the class, every attribute (the objects themselves, the
    hook dicts by content) and the state_dict's keys."""
    out = {"class": type(m), "state_dict": list(m.state_dict())}
    for k, v in vars(m).items():
        out[k] = dict(v) if k in HOOK_DICTS or isinstance(v, dict) else v
    return out


def _double(self, x):
    return 2 * nn.Linear.forward(self, x)


def _plus_one(inner, *args, **kwargs):
    return inner(*args, **kwargs) + 1


def _attach_everything(m: nn.Linear) -> None:
    hooks.swap_class(m, "a", hooks.derived_class(type(m), "Doubled", {"forward": _double}))
    hooks.wrap_call(m, "b", _plus_one)
    hooks.add_hooks(m, "c", pre=lambda _m, args: (args[0] * 3,), post=lambda _m, _a, out: out - 5, always_call=True)
    hooks.set_attrs(m, "d", in_features=99, _meshlm_new=object())


def test_detach_restores_the_module_exactly():
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    want, before = m(x), snapshot(m)
    _attach_everything(m)
    assert type(m).__name__ == "DoubledLinear" and m.in_features == 99
    # x * 3 -> 2 * linear(.) -> + 1 (the outer call wraps the hooks' _call_impl) ...
    torch.testing.assert_close(m(x), 2 * nn.Linear.forward(m, 3 * x) - 5 + 1)
    assert hooks.owners(m) == ["a", "b", "c", "d"]
    hooks.detach(m)
    assert snapshot(m) == before
    assert hooks.JOURNAL not in vars(m) and "_compiled_call_impl" not in vars(m)
    torch.testing.assert_close(m(x), want, rtol=0, atol=0)


def test_detach_by_owner_newest_first():
    m = nn.Linear(4, 3)
    before = snapshot(m)
    _attach_everything(m)
    hooks.detach(m, "c")  # hooks are independent of the rest
    assert not m._forward_hooks and not m._forward_pre_hooks and hooks.owners(m) == ["a", "b", "d"]
    hooks.swap_class(m, "e", hooks.derived_class(type(m), "Offloaded", {"extra": 1}))
    hooks.set_attrs(m, "e", in_features=7)
    with pytest.raises(meshlm.MeshlmError, match="'e'"):
        hooks.detach(m, "a")  # its class was changed again by "e": nothing undone
    with pytest.raises(meshlm.MeshlmError, match="'e'"):
        hooks.detach(m, "d")  # so was its attribute
    assert hooks.owners(m) == ["a", "b", "d", "e"] and type(m).__name__ == "OffloadedDoubledLinear"
    for owner in ("e", "d", "a", "b"):
        hooks.detach(m, owner)
    assert snapshot(m) == before


def test_a_call_wrapped_twice_around_a_compile_unwinds():
    """A pipeline's call wrapped, the block compiled in place, the call wrapped again (what
    StageModule._install does after a compile): detaching everything leaves no own call."""
    m = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    want = m(x)
    hooks.wrap_call(m, "pipeline", _plus_one)
    hooks.compile_call(m, "compile", backend="eager")
    hooks.wrap_call(m, "pipeline", _plus_one)
    torch.testing.assert_close(m(x), want + 1)  # the compile replaced the first wrapper
    with pytest.raises(meshlm.MeshlmError, match="'compile'"):
        hooks.detach(m, "pipeline")
    hooks.detach(m)
    assert "_compiled_call_impl" not in vars(m)
    torch.testing.assert_close(m(x), want, rtol=0, atol=0)


def test_derived_class_names():
    class Local(nn.Module):
        pass

    sharded = hooks.derived_class(Local, "Sharded", {"a": 1})
    assert sharded is hooks.derived_class(Local, "Sharded", {"a": 1})  # one class per (base, prefix, attrs)
    assert sharded.__name__ == "ShardedLocal" and sharded.__module__ == Local.__module__
    assert sharded.__qualname__ == Local.__qualname__.removesuffix("Local") + "ShardedLocal"
    off = hooks.derived_class(sharded, "Offloaded", {"b": 2})
    again = hooks.derived_class(off, "Sharded", {"c": 3})
    assert off.__name__ == "OffloadedShardedLocal" and again.__name__ == "OffloadedShardedLocal"
    assert (
        hooks.original_class(again) is hooks.original_class(sharded) is Local and hooks.original_class(Local) is Local
    )
    assert issubclass(again, off) and issubclass(off, sharded) and again.a == 1 and again.c == 3
    m = Local()
    hooks.swap_class(m, "lowering", sharded)
    assert repr(m) == "ShardedLocal()"
    for copy_it in (pickle.dumps, copy.deepcopy):
        with pytest.raises(meshlm.MeshlmError, match=r"meshlm.unshard\(model\)"):
            copy_it(m)
    hooks.detach(m)
    assert type(copy.deepcopy(m)) is Local


def _model():
    from meshlm.models import VLM, vlm_config

    return VLM(vlm_config("vlm_tiny"), device="meta")


def test_shard_then_detach_all_gives_back_the_users_modules():
    """vlm_fsdp_tp (scopes: forward hooks), blocks re-gathering (ZeRO-3), activation
    checkpointing, compiled bodies and compiled blocks: detached, every module has its
    class, attributes and hooks again (the parameters stay DTensors: meshlm.unshard's
    part)."""
    from meshlm.runtime.activation_checkpointing import apply_activation_checkpointing
    from meshlm.runtime.compile import compile_blocks

    model = _model()
    before = {n: snapshot(m) for n, m in model.named_modules()}
    meshlm.shard(model, "vlm_fsdp_tp", fake_mesh({"fsdp": 2, "tp": 2}))
    apply_activation_checkpointing(model, "full")
    compile_blocks(model, "eager")
    names = {type(m).__name__ for m in model.modules()}
    assert "ShardedVLM" in names and any(n.startswith("Sharded") and "Block" in n for n in names)
    assert any(m._forward_pre_hooks for m in model.modules())  # the scopes
    assert any("_compiled_call_impl" in vars(m) for m in model.modules())
    hooks.detach_all(model)
    assert list(hooks.attached(model)) == []
    for n, m in model.named_modules():
        got, want = snapshot(m), before[n]
        assert got.keys() == want.keys(), (n, got.keys() ^ want.keys())
        assert got["class"] is want["class"], n
        assert all(got[k] == want[k] for k in HOOK_DICTS), n
        assert got["state_dict"] == want["state_dict"], n
