"""`train` called again in one process reuses the jitted programs of an equal earlier run
(`jaxport.train._loop._programs`), and only of an equal one.

Each test starts from an empty cache of its own (monkeypatched), so the counts it reads are its
runs' alone, whatever ran before in this worker.
"""
import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxport.train import TrainConfig, train
from jaxport.train import _loop


@pytest.fixture
def programs(monkeypatch):
    """A fresh, empty `_programs` cache for the test (the module's own is restored after)."""
    fresh = functools.lru_cache(maxsize=2)(_loop._programs.__wrapped__)
    monkeypatch.setattr(_loop, "_programs", fresh)
    return fresh


def _cfg(tmp_path, name: str, **changes) -> TrainConfig:
    return TrainConfig(**{"workdir": str(tmp_path / name), "image_size": 16, "batch_size": 16, "epochs": 1,
                          "max_steps": 2, "devices": 1, "progress": False, **changes})


def _params(out: dict) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(jax.device_get(out["state"].params))]


def test_a_second_equal_run_reuses_the_programs_and_trains_the_same(tmp_path, programs, monkeypatch):
    built = []  # what the cached optimizer was built from
    real = _loop._recipe.optimizer
    monkeypatch.setattr(_loop._recipe, "optimizer", lambda r, spe: (built.append(r), real(r, spe))[1])
    first = train(_cfg(tmp_path, "a"), log=lambda m: None)
    assert (programs.cache_info().hits, programs.cache_info().misses) == (0, 1)
    # The key's fields alone, not the run's whole config: a setting the optimizer read but the
    # key lacked would be an AttributeError, not a program shared by runs it does not tell apart.
    assert len(built) == 1 and not isinstance(built[0], TrainConfig)
    with pytest.raises(AttributeError):
        built[0].workdir  # noqa: B018
    # Another workdir, step count and checkpoint interval: none of them is in a program.
    second = train(dataclasses.replace(_cfg(tmp_path, "b"), max_steps=1, checkpoint_every=7), log=lambda m: None)
    assert (programs.cache_info().hits, programs.cache_info().misses) == (1, 1)
    again = train(_cfg(tmp_path, "c"), log=lambda m: None)
    assert programs.cache_info().hits == 2 and len(built) == 1
    assert int(second["state"].step) == 1 and int(again["state"].step) == 2
    for a, b in zip(_params(first), _params(again), strict=True):
        np.testing.assert_array_equal(a, b)


# One setting the optimizer reads (the recipe), one the step's loss reads, one the model's build.
@pytest.mark.parametrize("change", [{"lr": 0.5}, {"label_smoothing": 0.3}, {"sync_bn": True, "devices": 2}],
                         ids=["lr", "label_smoothing", "sync_bn"])
def test_a_run_with_another_setting_gets_programs_of_its_own(tmp_path, programs, change):
    """Were the first run's programs reused, the second (same seed, same data) would end with
    the first one's weights."""
    first = train(_cfg(tmp_path, "a"), log=lambda m: None)
    other = train(_cfg(tmp_path, "b", **change), log=lambda m: None)
    assert (programs.cache_info().hits, programs.cache_info().misses) == (0, 2)
    assert any(not np.array_equal(a, b) for a, b in zip(_params(first), _params(other), strict=True))
