"""The README's Python blocks run as written, and the values in their comments are what they print.

The blocks are read from README.md itself, so an edit to either the README or the API that
breaks a snippet fails here. What a block leaves for the reader to supply (`images_nhwc`,
`labels`, a `model_best.pth.tar` on disk, `state_dict`) is made here, small: ResNet-50 at 32 px,
batch 2. The training block is run on ResNet-18 (the only change to its text) to keep
compilation within seconds; the names and calls it exercises are the same.
"""
import re
from pathlib import Path

import jax
import numpy as np
import torch
import torchvision

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _block(first_line_contains: str) -> str:
    found = [b for b in _python_blocks() if first_line_contains in b.splitlines()[0]]
    assert len(found) == 1, f"README.md has {len(found)} python blocks starting with {first_line_contains!r}"
    return found[0]


def test_readme_python_blocks_are_all_covered():
    # a new block must be added to this file (run, or named here with the reason it is not)
    firsts = [b.splitlines()[0] for b in _python_blocks()]
    assert firsts == [
        "import jax, jaxport, torch_compat",                     # test_port_block
        "model = models.resnet50(custom_vjps=False)",            # test_forward_mode_block
        'sd = torch_compat.flax_to_torch(variables, "resnet50")   # loads with strict=True, bit-exact round trip',
        "from jaxport import models, train as jt",               # test_train_block
        "import jax.numpy as jnp",                                # test_ops_block
    ]


def test_ops_block_prints_what_its_comments_say():
    namespace: dict = {}
    for line in _block("import jax.numpy as jnp").splitlines():
        code, _, comment = line.partition("#")
        if not code.strip():
            continue
        shown = re.match(r"\s*(\[\[.*?\]\]|-inf)", comment)
        if shown is None:  # an import or an assignment
            exec(code, namespace)
            continue
        got = np.asarray(eval(code, namespace))
        assert " ".join(str(got).split()) == shown.group(1), (code, got, comment)


def test_port_block_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    # saved as PyTorch's ImageNet example saves it: DataParallel keys inside a training-script dict
    torch.save({"epoch": 3, "arch": "resnet50", "state_dict": torch.nn.DataParallel(model).state_dict(),
                "best_acc1": torch.tensor(71.2)}, "model_best.pth.tar")
    namespace = {"images_nhwc": np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32)}
    exec(_block("import jax, jaxport, torch_compat"), namespace)
    assert namespace["arch"] == "resnet50"  # as its comment says
    assert set(namespace["variables"]) == {"params", "batch_stats"}
    assert namespace["logits"].shape == (2, 1000)
    assert set(namespace["updates"]) == {"batch_stats"}
    # the export one-liner further down, on the same variables
    exec(_block("sd = torch_compat.flax_to_torch"), namespace)
    missing, unexpected = model.load_state_dict(namespace["sd"], strict=True)
    assert not missing and not unexpected
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in namespace["sd"].items())  # bit-exact round trip


def test_forward_mode_block():
    # `models`, `loss`, `params` and `direction` are the reader's; the block's claim is that a
    # model built with custom_vjps=False goes through jax.jvp of jax.grad (forward over reverse)
    from jaxport import models
    block = _block("model = models.resnet50(custom_vjps=False)").replace("resnet50(", "resnet18(num_classes=3, ")
    x = np.ones((2, 16, 16, 3), np.float32)
    namespace: dict = {"jax": jax, "models": models}
    exec(block.splitlines()[0], namespace)
    variables = namespace["model"].init(jax.random.PRNGKey(0), x)
    namespace["params"] = variables["params"]
    namespace["direction"] = jax.tree.map(np.ones_like, variables["params"])
    namespace["loss"] = jax.jit(  # jitted: one compile instead of seconds of op-by-op dispatch
        lambda p: namespace["model"].apply({"params": p, "batch_stats": variables["batch_stats"]}, x).sum())
    exec(block.splitlines()[1], namespace)
    assert jax.tree.structure(namespace["hvp"]) == jax.tree.structure(variables["params"])


def test_train_block_runs_one_step():
    block = _block("from jaxport import models, train as jt").replace("resnet50(", "resnet18(")
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    n = len(jax.devices()) * 2
    namespace = {"state_dict": torchvision.models.resnet18(num_classes=10).state_dict(),
                 "images_nhwc": rng.normal(size=(n, 32, 32, 3)).astype(np.float32),
                 "labels": rng.integers(0, 10, size=n)}
    exec(block, namespace)
    metrics = namespace["metrics"]
    assert np.isfinite(float(metrics["loss"])), metrics
    assert namespace["mesh"].axis_names == ("data",)  # as its comment says
