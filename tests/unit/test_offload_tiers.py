"""The offload tiers' settings and swap store (meshlm/layout/offload.py, store.py, runtime.py):
a layout's ``offload`` section under the run's ``offload.*`` keys, the refusals (naming
the key and where it was set), and the disk tier's files: bytes back bit for bit, storage
freed while out, per-run directories, cleanup, and the errors for a bad directory or a
full disk, raised before anything is written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from meshlm.app.config import load_config, offload_spec
from meshlm.core.errors import ConfigError
from meshlm.layout.rules import parse_layout
from meshlm.runtime.offload import OffloadSpec, resolve_offload
from meshlm.runtime.offload.runtime import Offload
from meshlm.runtime.offload.store import SwapDir, Swapper


def test_run_settings_override_the_layout_kind_by_kind():
    lay = parse_layout({"params": {}, "offload": {"optimizer": "host", "activations": "disk"}}, source="l.yaml")
    assert lay.offload == OffloadSpec(optimizer="host", activations="disk")
    spec = offload_spec(load_config(["offload.optimizer=disk"]), lay)
    assert spec == OffloadSpec(optimizer="disk", activations="disk")  # activations: the layout's
    assert spec.label() == "optimizer=disk,activations=disk"
    assert offload_spec(load_config([]), None) == OffloadSpec() and not OffloadSpec().active
    assert resolve_offload(None, {"optimizer": None}) == OffloadSpec()


def test_every_kind_is_accepted_and_the_run_overrides_the_layout():
    lay = parse_layout({"offload": {"grads": "disk", "params": "host"}}, source="layouts/mine.yaml")
    assert offload_spec(load_config([]), lay) == OffloadSpec(grads="disk", params="host")
    # the run's own setting wins over the layout's, so the run can put it back on the device
    assert offload_spec(load_config(["offload.grads=device"]), lay) == OffloadSpec(params="host")
    assert load_config(["offload.grads=host"]).offload.grads == "host"


def test_an_unknown_tier_names_the_config_key():
    with pytest.raises(ConfigError, match=r"offload.optimizer='nvme' is not a tier; choose one of: device, host, disk"):
        load_config(["offload.optimizer=nvme"])


def test_swap_out_frees_the_storage_and_swap_in_restores_every_bit(tmp_path):
    d = SwapDir(tmp_path, rank=3, run_id="r")
    sw = Swapper("disk", d)
    t = torch.randn(1000, dtype=torch.float32)
    t[::7] = float("nan")  # any bit pattern
    want = t.clone()
    sw.swap_out(t)
    assert t.untyped_storage().nbytes() == 0 and sw.is_out(t)
    assert d.disk_bytes() == 4000 and sw.bytes_out == 4000
    sw.swap_in(t)
    assert torch.equal(t.view(torch.int32), want.view(torch.int32)) and not sw.is_out(t)
    view = want[10:20]  # a view does not own its storage: never swapped
    sw.swap_out(view)
    assert not sw.is_out(view) and want.untyped_storage().nbytes() == 4000
    assert sorted(os.listdir(d.path)) == [".owner", "t0.bin"] and d.path == tmp_path / "run-r" / "rank3"
    d.close()
    assert not (tmp_path / "run-r").exists()


def test_forget_removes_the_file_and_a_new_tensor_starts_afresh(tmp_path):
    d = SwapDir(tmp_path, 0, run_id="f")
    sw = Swapper("disk", d)
    t = torch.arange(1000.0)
    sw.swap_out(t)
    (f,) = [p for p in os.listdir(d.path) if p.endswith(".bin")]
    sw.forget(t)
    assert not os.path.exists(d.path / f) and not sw.is_out(t)
    # the same object written again is written, not taken as clean (its old copy is gone)
    t.untyped_storage().resize_(4000)
    t.copy_(torch.full((1000,), 7.0))
    sw.swap_out(t, clean=True)
    sw.swap_in(t)
    assert torch.equal(t, torch.full((1000,), 7.0))
    d.close()


def test_host_tier_on_a_cpu_tensor_moves_nothing(tmp_path):
    sw = Swapper("host")
    t = torch.ones(10)
    sw.swap_out(t)
    assert not sw.is_out(t) and t.untyped_storage().nbytes() == 40 and sw.bytes_out == 0


def test_two_runs_never_share_a_directory(tmp_path):
    SwapDir(tmp_path, 0, run_id="same")
    with pytest.raises(ConfigError, match="exists already; two runs would share swap files"):
        SwapDir(tmp_path, 0, run_id="same")


def test_a_killed_ranks_directory_is_removed_by_the_next_run(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / "run-old" / "rank0"
    stale.mkdir(parents=True)
    (stale / ".owner").write_text(f"{os.uname().nodename} {int(dead.stdout)}\n")
    (stale / "t0.bin").write_bytes(b"x" * 10)
    live = tmp_path / "run-live" / "rank0"
    live.mkdir(parents=True)
    (live / ".owner").write_text(f"{os.uname().nodename} {os.getpid()}\n")
    SwapDir(tmp_path, 0, run_id="new").close()
    assert not (tmp_path / "run-old").exists()  # its process is gone
    assert live.exists()  # a running process's files stay


def test_a_full_disk_is_refused_before_anything_is_written(tmp_path):
    d = SwapDir(tmp_path, 0, run_id="r")
    with pytest.raises(ConfigError) as e:
        d.need(1 << 62, "offload.optimizer=disk (optimizer state and masters)")
    msg = str(e.value)
    assert msg.startswith(f"offload.dir={str(tmp_path)!r}: offload.optimizer=disk (optimizer state and masters) needs")
    assert "free space, point offload.dir at a larger disk" in msg
    assert not d.path.exists()  # nothing left behind


def test_a_missing_or_unwritable_offload_dir_is_a_clear_error(tmp_path):
    spec = OffloadSpec(optimizer="disk", dir=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"offload.dir='.*nope' does not exist; create it"):
        Offload(spec, tmp_path, run_id="r")
    assert not (tmp_path / "nope").exists()  # a typo does not create a directory
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        Offload(OffloadSpec(optimizer="disk", dir=str(f)), tmp_path, run_id="r")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="not writable"):
            Offload(OffloadSpec(optimizer="disk", dir=str(ro)), tmp_path, run_id="r")


def test_the_default_disk_tier_is_under_the_run_directory(tmp_path):
    off = Offload(OffloadSpec(activations="disk"), tmp_path, run_id="r")
    assert off.disk.path == tmp_path / "offload" / "run-r" / "rank0"
    assert off.optimizer is None and off.activations is not None
    off.close()
    assert not (tmp_path / "offload" / "run-r").exists()


def test_saved_activations_come_back_with_their_bytes_and_strides(tmp_path):
    from meshlm.runtime.offload.activations import ActivationOffload, _dense

    act = ActivationOffload("disk", SwapDir(tmp_path, 0, run_id="a"), min_bytes=64)
    base = torch.randn(8, 16, 4)
    for t in (base, base.transpose(0, 2), base.permute(1, 0, 2)):
        packed = act.pack(t)
        assert packed[0] == "disk" and len(os.listdir(act.dir)) == 1
        back = act.unpack(packed)
        assert back.stride() == t.stride() and torch.equal(back, t)
        del packed  # autograd dropping what it saved removes the file
        assert os.listdir(act.dir) == []
    gappy = base[:, ::2]  # a view with gaps stays where it is (its base is in memory anyway)
    assert not _dense(gappy) and act.pack(gappy) == ("kept", gappy)
    small = torch.ones(4)
    assert act.pack(small)[0] == "kept"
    w = torch.nn.Parameter(torch.randn(64, 64))  # a parameter, or a view of one: in memory anyway
    assert act.pack(w)[0] == "kept" and act.pack(w.t())[0] == "kept"
    assert act.moved_bytes == 3 * base.numel() * 4
    h = torch.randn(64, 64)  # one tensor saved twice (q and k read it): one copy
    first, second = act.pack(h), act.pack(h)
    assert second[1] is first[1] and act.moved_bytes == 3 * base.numel() * 4 + h.numel() * 4
    h.add_(1)  # changed in place since: a new copy
    assert act.pack(h)[1] is not first[1]


def test_activation_hooks_do_not_change_gradients(tmp_path):
    from meshlm.runtime.offload.activations import ActivationOffload

    act = ActivationOffload("disk", SwapDir(tmp_path, 0, run_id="g"), min_bytes=64)
    torch.manual_seed(0)
    x, w = torch.randn(32, 64), torch.randn(64, 48, requires_grad=True)

    def grad(ctx):
        with ctx:
            y = (torch.tanh(x @ w).transpose(0, 1) ** 2).sum()
        y.backward()
        g, w.grad = w.grad.clone(), None
        return g

    import contextlib

    want = grad(contextlib.nullcontext())
    assert torch.equal(grad(act.context()), want) and act.moved_bytes > 0


def test_a_read_ahead_is_waited_for_and_a_clean_tensor_is_not_written_again(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    sw = Swapper("disk", SwapDir(tmp_path, 0, run_id="p"))
    t = torch.arange(4096, dtype=torch.float32)
    want = t.clone()
    sw.swap_out(t)
    with ThreadPoolExecutor(1) as pool:
        assert sw.swap_in_async(t, pool) and not sw.swap_in_async(t, pool)  # one read at a time
        sw.swap_in(t)  # waits for it
    assert torch.equal(t, want) and not sw.is_out(t) and sw.bytes_in == t.numel() * 4
    written = sw.bytes_out
    sw.swap_out(t, clean=True)  # unchanged since it came in: its file is current
    assert t.untyped_storage().nbytes() == 0 and sw.bytes_out == written == sw.disk.disk_bytes()
    sw.swap_in(t)
    t.add_(1)  # changed: written again
    sw.swap_out(t)
    sw.swap_in(t)
    assert torch.equal(t, want + 1)
    with ThreadPoolExecutor(1) as pool:  # read ahead, then out again without use: still correct
        sw.swap_out(t)
        sw.swap_in_async(t, pool)
        sw.swap_out(t, clean=True)
        sw.swap_in(t)
    assert torch.equal(t, want + 1)


def test_meshlm_train_refuses_parameters_offloaded_in_a_pipeline(tmp_path):
    """offload.params under pp is refused before any file, with the kinds that work there;
    offload.grads under pp opens (tests/dist/test_train_offload.py trains with it)."""
    from meshlm.layout.rules import load_layout
    from meshlm.runtime.offload.runtime import open_offload

    cfg = load_config(["layout=pp", "mesh=pp2", "offload.params=disk"])
    with pytest.raises(
        ConfigError, match=r"offload.params=disk with the pipeline layout pp \(pp=2\): a stage keeps .*offload.grads"
    ):
        open_offload(offload_spec(cfg, load_layout("pp")), load_layout("pp"), cfg.mesh.pp, tmp_path, 0)
    assert not (tmp_path / "offload").exists()  # refused before any file
    cfg = load_config(["layout=pp", "mesh=pp2", "offload.grads=disk"])
    grads = open_offload(offload_spec(cfg, load_layout("pp")), load_layout("pp"), 2, tmp_path, 0)
    assert grads is not None and grads.grads is not None
    grads.close()
    cfg = load_config(["layout=pp", "mesh=pp2"])
    assert open_offload(offload_spec(cfg, load_layout("pp")), load_layout("pp"), 2, tmp_path, 0) is None
