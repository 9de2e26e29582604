"""argparse's refusals, for every command: one line on stderr naming the flag, the value, what
was expected and the fix (the closest choice or flag for a misspelling), exit status 2, no
usage block and no traceback. `jaxport train`'s own flags are tested in test_train_cli_flags.py.

Every command line here is refused while parsing, so no test reads or writes a file.
"""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from jaxport._cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
ARCHS = ("resnet18, resnet34, resnet50, resnet101, resnet152, resnext50_32x4d, resnext101_32x8d, resnext101_64x4d, "
         "wide_resnet50_2, wide_resnet101_2")
COMMANDS = list(build_parser()._subparsers._group_actions[0].choices)


def _refused(capsys, *argv) -> str:
    """The one-line error `jaxport *argv` exits with (status 2), without its prefix."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, (exit_info.value.code, captured.err)
    assert captured.out == ""
    assert captured.err.startswith("jaxport: error: ") and captured.err.count("\n") == 1, captured.err
    assert "usage:" not in captured.err
    return captured.err.removeprefix("jaxport: error: ").rstrip("\n")


@pytest.mark.parametrize("argv, message", [
    # argparse printed the usage block, then "invalid choice: 'resnet5' (choose from 'auto', ...)".
    (["port", "--arch", "resnet5"], f"`--arch` (='resnet5') must be one of auto, {ARCHS}; did you mean --arch resnet50?"),
    (["verify", "x.pth", "--arch", "ResNet-18"], f"`--arch` (='ResNet-18') must be one of auto, {ARCHS}; did you mean "
                                                 "--arch resnet18?"),
    (["export", "v", "--out", "x.pt", "--arch", "resnet5"], f"`--arch` (='resnet5') must be one of {ARCHS}; did you "
                                                            "mean --arch resnet50?"),
    (["port", "--dtype", "bf16"], "`--dtype` (='bf16') must be one of keep, float32, float16, bfloat16; did you mean "
                                  "--dtype bfloat16?"),
    (["port", "--dtype", "half"], "`--dtype` (='half') must be one of keep, float32, float16, bfloat16; did you mean "
                                  "--dtype float16?"),  # torch's name, which no spelling matched
    *[(["port", "--dtype", alias], f"`--dtype` (='{alias}') must be one of keep, float32, float16, bfloat16; did you "
                                   f"mean --dtype {meant}?")
      for alias, meant in [("fp16", "float16"), ("f16", "float16"), ("fp32", "float32"), ("f32", "float32"),
                           ("single", "float32")]],
    (["port", "--dtype", "int8"], "`--dtype` (='int8') must be one of keep, float32, float16, bfloat16"),
    (["verify", "x.pth", "--mode", "evl"], "`--mode` (='evl') must be one of eval, train, both; did you mean --mode eval?"),
    (["prot"], "`prot` is not a `jaxport` command (one of port, verify, export, env, train); did you mean "
               "`jaxport port`?"),
    (["xyzzy"], "`xyzzy` is not a `jaxport` command (one of port, verify, export, env, train); see `jaxport --help`"),
])
def test_a_misspelt_choice_or_command_suggests_the_closest(capsys, argv, message):
    assert _refused(capsys, *argv) == message


@pytest.mark.parametrize("argv, message", [
    # These reached the top-level parser: "usage: jaxport ..." and "unrecognized arguments", no fix.
    (["port", "--outt", "x.safetensors"], "`--outt` is not a `jaxport port` flag; did you mean --out?"),
    (["port", "--backbone_only"], "`--backbone_only` is not a `jaxport port` flag; did you mean --backbone-only?"),
    (["verify", "x.pth", "--train_rtol=1e-3"], "`--train_rtol` is not a `jaxport verify` flag; did you mean --train-rtol?"),
    (["export", "v", "--out", "x.pt", "--froce"], "`--froce` is not a `jaxport export` flag; did you mean --force?"),
    (["env", "--verbose"], "`--verbose` is not a `jaxport env` flag; see `jaxport env --help` for the flags"),
    (["--debug", "env"], "`--debug` is not a `jaxport` flag; see `jaxport --help` for the flags"),
    # Said before a missing --out or --workdir, which the misspelt flag meant.
    (["export", "v", "--outt", "x.pt"], "`--outt` is not a `jaxport export` flag; did you mean --out?"),
    (["train", "--wrokdir", "w"], "`--wrokdir` is not a `jaxport train` flag; did you mean --workdir?"),
    (["port", "a.pth", "b.pth"], "`jaxport port` takes at most 1 positional argument (checkpoint), so 'b.pth' is one "
                                 "too many; see `jaxport port --help`"),
    (["verify", "a", "b", "c"], "`jaxport verify` takes at most 2 positional arguments (checkpoint, variables), so 'c' "
                                "is one too many; see `jaxport verify --help`"),
    (["env", "now"], "`jaxport env` takes no positional arguments (got 'now'); see `jaxport env --help`"),
])
def test_an_unknown_flag_or_argument_names_the_command_and_the_fix(capsys, argv, message):
    assert _refused(capsys, *argv) == message


@pytest.mark.parametrize("argv, message", [
    # argparse said "argument --batch-size: expected a positive integer, got '0'" after its usage block.
    (["verify", "x.pth", "--batch-size", "0"], "`--batch-size` (=0): expected a positive integer, e.g. --batch-size 2"),
    (["verify", "x.pth", "--image-size", "abc"], "`--image-size` (='abc'): expected a positive integer, e.g. "
                                                 "--image-size 64"),
    (["verify", "x.pth", "--rtol", "nan"], "`--rtol` (=nan): expected a finite number > 0, e.g. --rtol 0.0001"),
    (["verify", "x.pth", "--train-rtol", "-1"], "`--train-rtol` (=-1): expected a finite number > 0, e.g. "
                                                "--train-rtol 0.001"),
    (["verify", "x.pth", "--dilation", "F,T"], "`--dilation` (='F,T'): expected three booleans for layer2,layer3,"
                                               "layer4 (true/false, t/f or 1/0: torchvision's "
                                               "replace_stride_with_dilation), auto or none; got 2 values; e.g. "
                                               "--dilation F,T,T as torchvision's DeepLabV3 and FCN build their ResNet"),
    (["port", "--verify", "--dilation", "yes,no,no"], "`--dilation` (='yes,no,no'): expected three booleans for "
                                                      "layer2,layer3,layer4 (true/false, t/f or 1/0: torchvision's "
                                                      "replace_stride_with_dilation), auto or none; got 'yes', not a "
                                                      "boolean; e.g. --dilation F,T,T as torchvision's DeepLabV3 and "
                                                      "FCN build their ResNet"),
    (["export", "v", "--out", "x.pt", "--force=yes"], "`--force` (='yes') takes no value: pass --force alone to turn "
                                                      "it on, or leave it out"),
    # argparse's own words stay, on one line, pointing at the command's help.
    ([], "`jaxport` needs a command: port, verify, export, env, train; e.g. `jaxport port --help`"),
    (["verify"], "the following arguments are required: checkpoint; see `jaxport verify --help`"),
    (["export", "v"], "the following arguments are required: --out; see `jaxport export --help`"),
    (["port", "--out"], "argument --out: expected one argument; see `jaxport port --help`"),
])
def test_a_bad_value_or_a_missing_argument_is_one_line(capsys, argv, message):
    assert _refused(capsys, *argv) == message


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_refuses_an_unknown_flag_in_one_line(capsys, command):
    """Commands added later get the same errors: argparse builds them with the top-level's class."""
    assert _refused(capsys, command, "--no-such-flag").startswith(f"`--no-such-flag` is not a `jaxport {command}` flag")


@pytest.mark.parametrize("command", [[], ["port"], ["export"]])
def test_help_still_prints_the_full_help(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"usage: {' '.join(['jaxport', *command])} ") and "options:" in captured.out
    assert captured.err == ""


@pytest.mark.parametrize("argv, fragment", [
    (["port", "--arch", "resnet5"], "did you mean --arch resnet50?"),
    ([], "`jaxport` needs a command"),
])
def test_a_user_sees_one_line_and_status_2_with_no_traceback(argv, fragment):
    proc = subprocess.run([sys.executable, "-m", "jaxport", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("jaxport: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert fragment in proc.stderr


def test_abandoned_checkpoint_reads_are_not_logged():
    """A damaged checkpoint: orbax raised the first failed read (the command's one line) and left
    the others pending; asyncio logged each as "Future exception was never retrieved", with
    tensorstore's whole spec, as it was collected: hundreds of lines after the error."""
    import logging

    from jaxport import _cli

    def record(message, error):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, f"{message}\nfuture: <Future finished>",
                                 None, (type(error), error, None))

    read = ValueError('OUT_OF_RANGE: Error reading "params.fc.kernel/0" in OCDBT database at local file "w/": ...')
    keep = _cli._ABANDONED_READS.filter
    assert not keep(record("Future exception was never retrieved", read))
    assert not keep(record("Task exception was never retrieved", read))
    assert not keep(record("_GatheringFuture exception was never retrieved", read))  # asyncio.gather's
    assert keep(record("Future exception was never retrieved", ValueError("a user's own future")))
    assert keep(record("Exception in callback", read))
    with pytest.raises(SystemExit):
        _cli.main(["--version"])
    assert _cli._ABANDONED_READS in logging.getLogger("asyncio").filters
    with warnings.catch_warnings(record=True) as seen:  # the reads that never started
        warnings.warn("coroutine '_read_array_index_and_device_put' was never awaited", RuntimeWarning)
        warnings.warn("coroutine 'mine' was never awaited", RuntimeWarning)
    assert [str(w.message) for w in seen] == ["coroutine 'mine' was never awaited"]
