"""The examples in the jaxport.ops docstrings run and print what they claim."""
import doctest

import pytest

from jaxport.ops import _logsumexp, _rank, _topk


@pytest.mark.parametrize("module", [_rank, _topk, _logsumexp], ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
