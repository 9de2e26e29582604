"""What a checkpoint save costs, and that the checkpoints written before still read.

Orbax's default handler wrote each replicated array "replica-parallel": every device wrote a
slice of its copy, cut by an eager `lax.slice` compiled anew for each array shape and device
(~1,000 compilations, ~8 s, in the first save of a one-step ResNet-18 run on 8 CPU devices).
jaxport's handler writes each array from one replica; the files are read the same way.
"""
import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxport._errors import CheckpointError
from jaxport.train import _checkpoint
from jaxport.train._step import make_mesh


def _replicated_state(mesh):
    """A TrainState-like tree replicated on every device; shapes no other test uses, so no
    slice of them is in jax's in-process cache already."""
    rep = NamedSharding(mesh, P())
    tree = {"step": jnp.int32(7),
            "params": {"w": jnp.arange(24 * 3 * 5, dtype=jnp.float32).reshape(24, 3, 5),
                       "b": jnp.linspace(-1.0, 1.0, 40)},
            "batch_stats": {"mean": jnp.full((56,), 0.25), "var": jnp.full((56,), 2.0)},
            "opt_state": {"trace": jnp.ones((24, 3, 5)) * 0.5}}
    return jax.device_put(tree, rep)


def test_saving_a_replicated_state_compiles_nothing_and_restores_it(tmp_path):
    mesh = make_mesh(None)
    assert mesh.devices.size == 8  # conftest's simulated devices: 8 replicas of every array
    state = _replicated_state(mesh)
    compiles = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    mngr = _checkpoint.manager(str(tmp_path / "w"))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        _checkpoint.save(mngr, 7, state, {"arch": "resnet18"})
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == [], f"{len(compiles)} compilation(s) during one save"

    restored, meta = _checkpoint.restore(_checkpoint.manager(str(tmp_path / "w")), state)
    assert meta == {"arch": "resnet18"}
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))
        assert b.sharding.is_equivalent_to(a.sharding, a.ndim), jax.tree_util.keystr(path)


def test_a_checkpoint_written_with_orbaxs_standard_handler_still_restores(tmp_path):
    """Workdirs of earlier jaxport versions hold `state` written by orbax's
    StandardCheckpointHandler: `--resume` and `jaxport export` must read them."""
    mesh = make_mesh(None)
    state = _replicated_state(mesh)
    old = ocp.CheckpointManager(
        _checkpoint.checkpoint_dir(str(tmp_path / "w")),
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
        item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
    old.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"epoch": 1})))
    old.wait_until_finished()

    restored, meta = _checkpoint.restore(_checkpoint.manager(str(tmp_path / "w")), state)
    as_saved, meta2 = _checkpoint._read_as_saved(_checkpoint.manager(str(tmp_path / "w"), reader=True), 3)
    assert meta == meta2 == {"epoch": 1}
    for a, b, c in zip(jax.tree.leaves(state), jax.tree.leaves(restored), jax.tree.leaves(as_saved)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
        np.testing.assert_array_equal(np.asarray(c), np.asarray(a))


def test_the_finiteness_check_before_a_save_compiles_nothing_and_sees_every_leaf():
    """Every checkpoint is preceded by a check that the weights are finite. A jitted reduction
    over the leaves compiled for 1-2 s in every process of every run; it is read on the host."""
    import ml_dtypes

    from jaxport.train import _loop

    state = _replicated_state(make_mesh(None))
    compiles = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        assert _loop._all_finite(state) is True
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == [], f"{len(compiles)} compilation(s) in one check"
    for bad in (np.inf, -np.inf, np.nan):
        for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
            leaf = np.ones((3, 4), dtype)
            leaf[2, 1] = bad
            tree = {**state, "params": {**state["params"], "x": jax.device_put(leaf, state["params"]["w"].sharding)}}
            assert _loop._all_finite(tree) is False, (bad, dtype)
    assert _loop._all_finite({"n": jnp.int32(2**31 - 1), "w": np.zeros(2, np.float32)}) is True


def _statvfs_with(monkeypatch, favail, files=10**6):
    """`os.statvfs` (which `shutil.disk_usage` reads too) as the real one, but with `favail()`
    inodes free of `files`: the bytes free stay the real ones."""
    real = os.statvfs

    def fake(path):
        st = real(path)
        return os.statvfs_result((*st[:5], files, favail(), favail(), *st[8:]))

    monkeypatch.setattr(os, "statvfs", fake)


def test_a_file_system_out_of_inodes_is_named_before_the_save_writes(tmp_path, monkeypatch):
    """A tmpfs with 16 inodes and 300 MB free failed the first save mid-way with "the disk is
    full: free some space" though `df -h` showed it was not: the check asked only for bytes."""
    mngr = _checkpoint.manager(str(tmp_path / "w"))
    _statvfs_with(monkeypatch, lambda: 13)
    with pytest.raises(CheckpointError) as e:
        _checkpoint.save(mngr, 2, {"w": np.ones(4, np.float32)}, {})
    assert re.fullmatch(r"could not write checkpoint step 2 in .*/w/checkpoints: no free inodes \(files\) left to "
                        r"save it: it needs up to \d+ new files and 13 can be made there, though [\d.]+ MB are free; "
                        r"delete some files there or write elsewhere; no checkpoint was written yet", str(e.value))
    assert os.listdir(tmp_path / "w" / "checkpoints") == []  # refused before orbax made anything
    # A file system that does not count inodes (btrfs, NFS: 0 in all) is not refused.
    monkeypatch.undo()
    _statvfs_with(monkeypatch, lambda: 0, files=0)
    _checkpoint.save(mngr, 2, {"w": np.ones(4, np.float32)}, {})
    mngr.close()
    assert os.listdir(tmp_path / "w" / "checkpoints") == ["2"]


@pytest.mark.parametrize("out_of", ["inodes", "bytes"])
def test_a_save_that_runs_out_of_room_midway_is_one_line(tmp_path, monkeypatch, caplog, capfd, out_of):
    """Another process took the file system's last inodes (or bytes) after the check: each of
    orbax's writer threads logged its RESOURCE_EXHAUSTED with a full traceback (~140 lines on a
    terminal) before the error's one line, which said "the disk is full" for inodes too."""
    from orbax.checkpoint._src.serialization import jax_array_handlers

    inodes = [10**5]

    async def write_fails(*args, **kwargs):  # in orbax's "array_type_handler" thread, as tensorstore fails
        inodes[0] = 0 if out_of == "inodes" else inodes[0]
        raise ValueError('RESOURCE_EXHAUSTED: Error writing "params.w/0" in OCDBT database at local file "...": '
                         "Failed to open: \"...\": No space left on device [os_error_code='28']")

    mngr = _checkpoint.manager(str(tmp_path / "w"))
    _checkpoint.save(mngr, 1, {"w": jnp.ones(4)}, {})
    _statvfs_with(monkeypatch, lambda: inodes[0])
    monkeypatch.setattr(jax_array_handlers, "_async_serialize_replica_slices", write_fails)
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG), pytest.raises(CheckpointError) as e:
        _checkpoint.save(mngr, 2, {"w": jnp.ones(4)}, {})
    mngr.close()
    why = (r"no free inodes \(files\) left on its file system, though [\d.]+ MB are free: delete some files there"
           if out_of == "inodes" else "the disk is full: free some space")
    assert re.fullmatch(rf"could not write checkpoint step 2 in .*/w/checkpoints: {why}; the latest checkpoint, "
                        r"step 1, is intact: rerun with --resume to continue from it", str(e.value)), str(e.value)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert capfd.readouterr().err == ""
    assert sorted(os.listdir(tmp_path / "w" / "checkpoints")) == ["1"]  # its temporary directory removed


def test_an_error_orbax_logs_during_a_save_that_succeeds_is_still_logged(tmp_path, monkeypatch, caplog):
    """Only a failed save's logging is dropped (its error says it all): orbax logs, and goes on,
    when e.g. the rotation cannot remove the oldest step, and that must still be seen."""
    finish, said = ocp.CheckpointManager.wait_until_finished, []

    def logs_an_error(self):
        if not said:  # once: orbax's save waits too
            said.append(True)
            logging.getLogger("absl").error("Failed to remove checkpoint (%s)", "step 0")
        return finish(self)

    mngr = _checkpoint.manager(str(tmp_path / "w"))
    with caplog.at_level(logging.WARNING), monkeypatch.context() as m:
        m.setattr(ocp.CheckpointManager, "wait_until_finished", logs_an_error)
        _checkpoint.save(mngr, 1, {"w": jnp.ones(4)}, {})
        logged = [(r.name, r.getMessage()) for r in caplog.records]
    mngr.close()
    assert logged == [("absl", "Failed to remove checkpoint (step 0)")], logged
