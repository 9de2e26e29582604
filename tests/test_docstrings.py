"""The examples in the docstrings run and print what they claim."""
import doctest
import importlib
import pkgutil

import pytest

import jaxport
import torch_compat
from jaxport.ops import _logsumexp, _rank, _topk


@pytest.mark.parametrize("module", [_rank, _topk, _logsumexp], ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def _modules():
    for package in (jaxport, torch_compat):
        yield package.__name__
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not info.name.endswith("__main__"):  # runs the CLI when imported
                yield info.name


@pytest.mark.parametrize("name", list(_modules()))
def test_no_docstring_example_fails(name):
    """Every `>>>` line runs or is marked `# doctest: +SKIP`: load_state_dict's example used a
    file no reader has on its second line, unmarked."""
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
