"""Data flows one way: the JAX side never imports torch; only torch_compat does."""
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import serving

REPO = Path(__file__).resolve().parents[1]


def test_jax_side_does_not_import_torch():
    code = ("import sys, jaxport, jaxport.models, jaxport.ops, jaxport.train, jaxport._io, jaxport._cli\n"
            "v = jaxport.models.resnet18()\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'torchvision', 'torch_compat')))\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_cli_entry_point_imports_no_jax():
    """The console script imports `jaxport._cli` first: it must load no jax (a second or more), so
    that its Ctrl-C/SIGTERM handling is in place before that time (see test_cli_signals.py)."""
    _assert_loads_none_of("jaxport._cli", ("jax", "jaxlib", "flax", "torch"))


def _assert_loads_none_of(modules: str, packages: tuple[str, ...]) -> None:
    """`import <modules>` in a fresh Python loads no module of `packages`."""
    code = (f"import sys, {modules}\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {packages!r})\n"
            "assert not bad, bad[:10]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_every_public_name_of_jaxport_resolves():
    """`jaxport`'s names load on first use; each one named in `__all__` must arrive."""
    import jaxport

    assert sorted(jaxport.__all__) == sorted(jaxport._LAZY)
    for name in jaxport.__all__:
        assert getattr(jaxport, name) is not None
    from jaxport import ConfigError, ops

    assert issubclass(ConfigError, jaxport.JaxportError) and callable(ops.rank)
    assert "models" in dir(jaxport)
    try:
        jaxport.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("jaxport.no_such_name resolved")


def test_a_data_loader_worker_imports_no_jax():
    """A spawned DataLoader worker unpickles its dataset from `jaxport.train._data` (and the CLI's
    warning display from `jaxport._cli`): importing jax, flax, optax and orbax there cost every
    worker ~1.5 s and ~200 MB each time an epoch's loading or evaluation started."""
    _assert_loads_none_of("jaxport.train._data, jaxport._cli", ("jax", "jaxlib", "flax", "optax", "orbax"))


def test_every_public_name_of_jaxport_train_resolves():
    import jaxport.train

    assert sorted(jaxport.train.__all__) == sorted(jaxport.train._LAZY)
    for name in jaxport.train.__all__:
        assert getattr(jaxport.train, name) is not None
    from jaxport.train import TrainConfig, train

    assert callable(train) and TrainConfig is jaxport.train._loop.TrainConfig
    # Kept in the package once resolved: later lookups do not go through __getattr__ again.
    assert vars(jaxport.train)["TrainConfig"] is TrainConfig
    assert sorted(dir(jaxport.train)) == sorted(jaxport.train.__all__)
    try:
        jaxport.train.no_such_name
    except AttributeError as e:
        assert "jaxport.train" in str(e) and "no_such_name" in str(e)
    else:
        raise AssertionError("jaxport.train.no_such_name resolved")


def test_torch_compat_loads_torchvision_only_for_the_names_that_build_its_models(tmp_path):
    """Importing torchvision costs ~1.4 s (torchvision.ops pulls in torch._dynamo), which every
    `jaxport export`, `jaxport port CHECKPOINT`, `jaxport port` of the built embedded default and
    `jaxport train --init` paid though none of them builds a torchvision model (nor does a
    download by URL). Here they run in one fresh process, which then checks that torchvision
    never arrived, and that the names that do need it still resolve."""
    import torch
    import torchvision

    import torch_compat
    from torch_compat import _default

    eager = {n for n in torch_compat.__all__ if n not in torch_compat._LAZY}
    assert set(torch_compat._LAZY) <= set(torch_compat.__all__) and eager
    assert sorted(dir(torch_compat)) == sorted(torch_compat.__all__)
    for name in torch_compat.__all__:
        assert getattr(torch_compat, name) is not None, name
    assert torch_compat.cross_check is torch_compat._crosscheck.cross_check

    torch.save(torchvision.models.resnet18(num_classes=7).state_dict(), tmp_path / "r18.pth")
    # `port` with no checkpoint needs torchvision to build the embedded default, not to port it once built.
    _default.default_checkpoint(tmp_path / "cache" / _default.FILENAME)
    code = (
        "import sys\n"
        "from jaxport._cli import main\n"
        f"d = {str(tmp_path)!r}\n"
        "assert main(['port', d + '/r18.pth', '--out', d + '/r18.safetensors']) == 0\n"
        "assert main(['port', sys.argv[1] + '/r18.pth', '--out', d + '/url.safetensors']) == 0\n"  # a download too
        "assert main(['export', d + '/r18.safetensors', '--arch', 'resnet18', '--out', d + '/back.pt']) == 0\n"
        "assert main(['port', '--out', d + '/default.safetensors']) == 0\n"
        "import torch_compat\n"
        f"assert sorted(n for n in torch_compat.__all__ if n in vars(torch_compat)) == {sorted(eager)!r}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torchvision')\n"
        "assert not bad, bad[:10]\n"
        "torch_compat.reference_model\n"
        "assert 'torchvision' in sys.modules\n")
    with serving(tmp_path) as url:
        proc = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True, cwd=REPO, timeout=300,
                              env={**os.environ, "JAXPORT_CACHE": str(tmp_path / "cache"),
                                   "TORCH_HOME": str(tmp_path / "torch_home")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    downloaded = tmp_path / "torch_home" / "hub" / "checkpoints" / "r18.pth"
    assert downloaded.read_bytes() == (tmp_path / "r18.pth").read_bytes()
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    model = torchvision.models.resnet18(num_classes=7)
    model.load_state_dict(back, strict=True)
