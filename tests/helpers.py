"""Reference objects and fixtures' building blocks shared by tests (cached per test process)."""
import contextlib
import functools
import http.server
import os
import threading

import numpy as np
import torch_compat
from PIL import Image

ALL_ARCHS = (
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d", "wide_resnet50_2", "wide_resnet101_2",
)


@functools.lru_cache(maxsize=2)
def reference(arch: str, num_classes: int = 10):
    """A calibrated torchvision model (eval mode). Small heads keep the big models cheap."""
    return torch_compat.reference_model(arch, num_classes=num_classes, image_size=64)


def write_images(folder, n: int, start: int = 0, size: tuple[int, int] = (20, 24)) -> None:
    """`n` random RGB PNGs named `{start}.png`, ... in `folder` (created), each seeded by its name."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(start)
    for i in range(start, start + n):
        Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(os.path.join(folder, f"{i}.png"))


def torch_lrs(make_sched, n: int, lr: float = 0.1) -> np.ndarray:
    """The learning rate torch's scheduler `make_sched(optimizer)` gives at each of `n` steps
    (read before each `optimizer.step(); scheduler.step()`, as a training loop sees it)."""
    import torch

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = make_sched(opt)
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return np.array(lrs)


def rel_errors(got: dict, want: dict) -> dict[str, float]:
    """Each state_dict entry's max |got - want| relative to want's largest magnitude (counters left out)."""
    return {k: float(np.max(np.abs(got[k] - want[k])) / max(np.max(np.abs(want[k])), 1e-30))
            for k in want if not k.endswith("num_batches_tracked")}


@contextlib.contextmanager
def serving(directory):
    """An HTTP server on a free loopback port serving `directory`; yields its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # not the test's output
        pass
