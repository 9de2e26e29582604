"""`jaxport train`'s flags as a user types them: a refusal is one line naming the flag, the value,
what was expected and the fix, exit status 2, no traceback, and nothing written to --workdir.

Refused runs never train: argparse refuses them, or `TrainConfig`'s checks do before any work.
Values that parse are checked through the parsed `TrainConfig` (`config_from_args`), not a run.
"""
import re

import pytest

from jaxport._cli import build_parser, main
from jaxport.train import TrainConfig
from jaxport.train._cli import config_from_args


def _refused(capsys, tmp_path, *flags) -> str:
    """The one-line error `jaxport train --workdir W *flags` exits with (status 2)."""
    workdir = tmp_path / "w"
    try:
        code = main(["train", "--workdir", str(workdir), "--no-progress", *flags])
    except SystemExit as e:  # argparse's refusals
        code = e.code
    captured = capsys.readouterr()
    assert code == 2, (code, captured.err)
    assert captured.out == ""
    assert captured.err.startswith("jaxport: error: ") and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err and "usage:" not in captured.err
    assert not workdir.exists()
    return captured.err.removeprefix("jaxport: error: ").rstrip("\n")


def _parsed(*flags) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", "--workdir", "w", *flags]))


@pytest.mark.parametrize("flags, message", [
    # argparse printed its 11-line usage block, then "invalid int value: '1.5'" with no fix.
    (["--epochs", "1.5"], "`--epochs` (=1.5) must be an integer >= 1; use --epochs 1 or --epochs 2"),
    (["--epochs", "1e3"], "`--epochs` (=1e3) must be an integer >= 1; use --epochs 1000"),
    (["--epochs", ""], "`--epochs` (='') must be an integer >= 1"),
    (["--model-ema-steps", "2.5"], "`--model-ema-steps` (=2.5) must be an integer >= 1; use --model-ema-steps 2 or "
                                   "--model-ema-steps 3"),
    (["--model-ema-decay", "0,999"], "`--model-ema-decay` (='0,999') must be a number; use --model-ema-decay 0.999"),
    (["--epochs", "inf"], "`--epochs` (=inf) must be an integer >= 1"),
    (["--image-size", "16.0"], "`--image-size` (=16.0) must be an integer >= 1; use --image-size 16"),
    (["--seed", "abc"], "`--seed` (='abc') must be an integer >= 0"),
    (["--workers", "1.5"], "`--workers` (=1.5) must be an integer >= 0; use --workers 1 or --workers 2"),
    (["--ra-reps", "2.5"], "`--ra-reps` (=2.5) must be an integer >= 1; use --ra-reps 2 or --ra-reps 3"),
    (["--max-steps", "2.0"], "`--max-steps` (=2.0) must be an integer >= 1; use --max-steps 2"),
    (["--checkpoint-every", "x"], "`--checkpoint-every` (='x') must be an integer >= 1"),
    (["--keep-checkpoints", "3.5"], "`--keep-checkpoints` (=3.5) must be an integer >= 1; use --keep-checkpoints 3 "
                                    "or --keep-checkpoints 4"),
    (["--batch-size", "8.0"], "`--batch-size` (=8.0) must be a positive integer or 'auto'; use --batch-size 8"),
    (["--batch-size", ""], "`--batch-size` (='') must be a positive integer or 'auto'"),
    (["--lr", ""], "`--lr` (='') must be a number, e.g. --lr 0.05"),
    (["--lr", "abc"], "`--lr` (='abc') must be a number, e.g. --lr 0.05"),
    (["--lr", "0,1"], "`--lr` (='0,1') must be a number; use --lr 0.1"),  # a decimal comma
    (["--momentum", "x"], "`--momentum` (='x') must be a number, e.g. --momentum 0.9"),
    (["--weight-decay", "0,0005"], "`--weight-decay` (='0,0005') must be a number; use --weight-decay 0.0005"),
    (["--label-smoothing", "x"], "`--label-smoothing` (='x') must be a number, e.g. --label-smoothing 0.1"),
    (["--label-smoothing", "0,1"], "`--label-smoothing` (='0,1') must be a number; use --label-smoothing 0.1"),
    (["--lr-step-size", "2.5"], "`--lr-step-size` (=2.5) must be an integer >= 1; use --lr-step-size 2 or --lr-step-size 3"),
    (["--lr-warmup-epochs", "x"], "`--lr-warmup-epochs` (='x') must be an integer >= 0"),
    (["--lr-gamma", "0,5"], "`--lr-gamma` (='0,5') must be a number; use --lr-gamma 0.5"),
    (["--lr-min", "x"], "`--lr-min` (='x') must be a number, e.g. --lr-min 0.0"),
    (["--lr-warmup-decay", "x"], "`--lr-warmup-decay` (='x') must be a number, e.g. --lr-warmup-decay 0.01"),
    (["--norm-weight-decay", "x"], "`--norm-weight-decay` (='x') must be a number, e.g. --norm-weight-decay 0.0"),
    (["--clip-grad-norm", "x"], "`--clip-grad-norm` (='x') must be a number, e.g. --clip-grad-norm 1.0"),
    (["--wd", "0,0005"], "`--weight-decay` (='0,0005') must be a number; use --weight-decay 0.0005"),  # torchvision's alias
])
def test_a_value_of_the_wrong_type_is_one_line_with_the_fix(capsys, tmp_path, flags, message):
    assert _refused(capsys, tmp_path, *flags) == message


ARCHS = ("resnet18, resnet34, resnet50, resnet101, resnet152, resnext50_32x4d, resnext101_32x8d, resnext101_64x4d, "
         "wide_resnet50_2, wide_resnet101_2")


@pytest.mark.parametrize("flags, message", [
    # --arch was refused by the library with the list only; --dtype by argparse's usage block.
    (["--arch", "resnet-18"], f"`--arch` (='resnet-18') must be one of {ARCHS}; did you mean --arch resnet18?"),
    (["--arch", "ResNet50"], f"`--arch` (='ResNet50') must be one of {ARCHS}; did you mean --arch resnet50?"),
    (["--arch", "resnet19"], f"`--arch` (='resnet19') must be one of {ARCHS}; did you mean --arch resnet18?"),
    (["--arch", "wide_resnet50"], f"`--arch` (='wide_resnet50') must be one of {ARCHS}; did you mean "
                                  "--arch wide_resnet50_2?"),
    (["--arch", ""], f"`--arch` (='') must be one of {ARCHS}"),
    (["--dtype", "bf16"], "`--dtype` (='bf16') must be one of float32, bfloat16; did you mean --dtype bfloat16?"),
    (["--dtype", "BFLOAT16"], "`--dtype` (='BFLOAT16') must be one of float32, bfloat16; did you mean "
                              "--dtype bfloat16?"),
    (["--dtype", "float16"], "`--dtype` (='float16') must be one of float32, bfloat16 (float16 is not supported for "
                             "training: bfloat16 is the half-precision one); did you mean --dtype bfloat16?"),
    # By spelling alone float64 was sent to bfloat16, and fp16 / half to nothing.
    (["--dtype", "float64"], "`--dtype` (='float64') must be one of float32, bfloat16 (float64 is not supported for "
                             "training: float32 is the full-precision one); did you mean --dtype float32?"),
    (["--dtype", "half"], "`--dtype` (='half') must be one of float32, bfloat16 (float16 is not supported for "
                          "training: bfloat16 is the half-precision one); did you mean --dtype bfloat16?"),
    (["--bn-stats", "frist"], "`--bn-stats` (='frist') must be one of mean, first; did you mean --bn-stats first?"),
    (["--bn-stats", "avg"], "`--bn-stats` (='avg') must be one of mean, first"),
    (["--bn-mode", "frozn"], "`--bn-mode` (='frozn') must be one of train, eval, frozen; did you mean --bn-mode "
                             "frozen?"),
    (["--bn-mode", "eval", "--sync-bn"], "`--sync-bn` synchronises the batch statistics of train-mode BatchNorm, and "
                                         "with `--bn-mode` (=eval) BatchNorm normalises with its running statistics, "
                                         "the same on every device: leave out one of the two"),
    (["--opt", "adam"], "`--opt` (='adam') must be one of sgd, sgd-nesterov, adamw, rmsprop; did you mean --opt adamw?"),
    (["--opt", "nesterov"], "`--opt` (='nesterov') must be one of sgd, sgd-nesterov, adamw, rmsprop; did you mean --opt "
                            "sgd-nesterov?"),
    (["--lr-scheduler", "cosine"], "`--lr-scheduler` (='cosine') must be one of cosineannealinglr, steplr, "
                                   "exponentiallr; did you mean --lr-scheduler cosineannealinglr?"),
    (["--lr-scheduler", "step_lr"], "`--lr-scheduler` (='step_lr') must be one of cosineannealinglr, steplr, "
                                    "exponentiallr; did you mean --lr-scheduler steplr?"),
    (["--lr-warmup-method", "lin"], "`--lr-warmup-method` (='lin') must be one of linear, constant; did you mean "
                                    "--lr-warmup-method linear?"),
])
def test_a_misspelt_name_suggests_the_closest(capsys, tmp_path, flags, message):
    assert _refused(capsys, tmp_path, *flags) == message


@pytest.mark.parametrize("flags, message", [
    # These reached the top-level parser: "usage: jaxport ..." and "unrecognized arguments", no fix.
    (["--batchsize", "8"], "`--batchsize` is not a `jaxport train` flag; did you mean --batch-size?"),
    (["--sync_bn"], "`--sync_bn` is not a `jaxport train` flag; did you mean --sync-bn?"),
    (["--weight_decay=0"], "`--weight_decay` is not a `jaxport train` flag; did you mean --weight-decay?"),
    (["--devices", "2"], "`--devices` is not a `jaxport train` flag: jaxport train uses every device jax sees: hide "
                         "the others to use fewer (e.g. CUDA_VISIBLE_DEVICES=0,1), or call "
                         "jaxport.train.train(TrainConfig(devices=N))"),
    (["data/"], "`jaxport train` takes no positional arguments (got 'data/'); every setting is a flag, e.g. "
                "--data data/"),
    # argparse's own errors stay argparse's words, on one line, pointing at the help.
    (["--epochs"], "argument --epochs: expected one argument; see `jaxport train --help`"),
    (["--w", "x"], "ambiguous option: --w could match --weight-decay, --wd, --workdir, --workers; see "
                   "`jaxport train --help`"),
    (["--lr-warmup", "1"], "ambiguous option: --lr-warmup could match --lr-warmup-epochs, --lr-warmup-method, "
                           "--lr-warmup-decay; see `jaxport train --help`"),
])
def test_unknown_flags_and_argparse_errors_are_one_line_with_the_fix(capsys, tmp_path, flags, message):
    assert _refused(capsys, tmp_path, *flags) == message


def test_a_missing_workdir_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--epochs", "1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("jaxport: error: the following arguments are required: --workdir; see "
                                       "`jaxport train --help`\n")


@pytest.mark.parametrize("flags, message", [
    # Parsed, then refused by `TrainConfig`'s checks before any work: the same one-line shape.
    (["--epochs", "0"], "`--epochs` (=0) must be >= 1"),
    (["--grad-accum-steps", "0"], "`--grad-accum-steps` (=0) must be >= 1"),
    (["--batch-size", "-8"], "`--batch-size` (=-8) must be a positive integer or 'auto'"),
    (["--lr", "nan"], "`--lr` (=nan) must be a finite number > 0"),
    (["--lr", "1e400"], "`--lr` (=inf) must be a finite number > 0"),
    (["--lr=0.1", "--lr", "-1"], "`--lr` (=-1.0) must be a finite number > 0"),  # the last one given counts
    (["--seed", "99999999999999999999"], "`--seed` (=99999999999999999999) must be an integer from 0 to 2**63 - 1"),
    (["--data", ""], "`--data` (='') must be a path, or None"),
    # torch refuses > 1, and silently trains unsmoothed with a negative or NaN one.
    *[(["--label-smoothing", v], f"`--label-smoothing` (={v}) must be a number from 0 to 1, as torch's "
                                 "CrossEntropyLoss takes: the weight of the uniform target, e.g. 0.1; 0 for plain "
                                 "cross-entropy") for v in ("1.5", "-0.1", "nan")],
    # torchvision's train.py takes these four only
    (["--opt", "lamb"], "`--opt` (='lamb') must be one of sgd, sgd-nesterov, adamw, rmsprop"),
    (["--opt", "sgd-nesterov", "--momentum", "0"], "`--opt` (=sgd-nesterov) needs `--momentum` > 0 (it is 0.0): "
                                                   "nesterov momentum without momentum, which torch refuses; use --opt "
                                                   "sgd, or a --momentum such as 0.9"),
    # a cosine over the epochs after the warm-up: T_max = 0 divided by zero in torch
    (["--epochs", "3", "--lr-warmup-epochs", "3"], "`--lr-warmup-epochs` (=3) must be less than `--epochs` (=3) with "
                                                   "--lr-scheduler cosineannealinglr, which anneals over the epochs "
                                                   "after the warm-up (T_max = epochs - warm-up epochs = 0); use "
                                                   "--lr-warmup-epochs 2 or fewer, or --epochs 4 or more"),
    (["--lr-step-size", "0"], "`--lr-step-size` (=0) must be an integer >= 1: the epochs between the decays of "
                              "--lr-scheduler steplr, e.g. 30"),
    (["--lr-step-size", "-2"], "`--lr-step-size` (=-2) must be an integer >= 1: the epochs between the decays of "
                               "--lr-scheduler steplr, e.g. 30"),
    (["--lr-warmup-epochs", "-1"], "`--lr-warmup-epochs` (=-1) must be an integer >= 0: the epochs of warm-up before "
                                   "the --lr-scheduler, 0 for none"),
    *[(["--lr-gamma", v], f"`--lr-gamma` (={v}) must be a finite number > 0: the factor --lr-scheduler steplr or "
                          "exponentiallr multiplies the lr by at each decay, e.g. 0.1") for v in ("0.0", "-0.5", "nan")],
    (["--lr-min", "-0.001"], "`--lr-min` (=-0.001) must be a finite number >= 0: the lr that --lr-scheduler "
                             "cosineannealinglr ends at (torch's eta_min), e.g. 0"),
    *[(["--lr-warmup-decay", v], f"`--lr-warmup-decay` (={v}) must be a number in (0, 1]: the warm-up starts at --lr "
                                 "times it (torch's LinearLR start_factor, ConstantLR factor), e.g. 0.01")
      for v in ("0.0", "1.5", "nan")],
    (["--norm-weight-decay", "-0.1"], "`--norm-weight-decay` (=-0.1) must be a finite number >= 0 (the weight decay of "
                                      "the BatchNorm layers' parameters, e.g. 0), or left out to decay them by "
                                      "--weight-decay"),
    *[(["--bias-weight-decay", v], f"`--bias-weight-decay` (={v}) must be a finite number >= 0 (the weight decay of "
                                   "every bias: the classifier's and the BatchNorm layers', e.g. 0), or left out to "
                                   "decay them as the others") for v in ("-0.1", "nan")],
    *[(["--clip-grad-norm", v], f"`--clip-grad-norm` (={v}) must be a finite number > 0 (the largest norm of all "
                                "gradients together, torch's clip_grad_norm_ max_norm, e.g. 1), or left out for no "
                                "clipping") for v in ("0.0", "inf")],
    # torchvision's --model-ema: i % 0 divides by zero there; a decay above 1 diverges
    (["--model-ema", "--model-ema-steps", "0"], "`--model-ema-steps` (=0) must be an integer >= 1: the EMA is updated "
                                                "every this many steps, e.g. 32"),
    *[(["--model-ema", "--model-ema-decay", v], f"`--model-ema-decay` (={v}) must be a number in [0, 1]: the EMA's "
                                                "decay per image of a one-epoch run (scaled by the global batch, "
                                                "--model-ema-steps and --epochs), e.g. 0.99998")
      for v in ("1.5", "-0.1", "nan")],
])
def test_out_of_range_values_are_refused_before_any_work(capsys, tmp_path, flags, message):
    assert _refused(capsys, tmp_path, *flags) == message


def test_data_that_is_a_file_or_holds_no_classes_is_refused(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    assert _refused(capsys, tmp_path, "--data", str(tmp_path / "notes.txt")).startswith(
        f"`--data` (={tmp_path / 'notes.txt'}) is not a directory; pass an ImageFolder directory")
    (tmp_path / "empty").mkdir()
    assert _refused(capsys, tmp_path, "--data", str(tmp_path / "empty")).startswith(
        f"`--data` (={tmp_path / 'empty'}) holds no images: expected one sub-folder per class")


def test_a_workdir_that_is_a_file_is_refused(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    assert _refused(capsys, tmp_path, "--data", str(tmp_path), "--workdir", str(tmp_path / "f" / "run")) == (
        f"`--workdir` (={tmp_path / 'f' / 'run'}) is inside '{tmp_path / 'f'}', which is a file, not a directory; "
        "pass a new or existing directory")


@pytest.mark.parametrize("flags, field, value", [
    (["--batch-size", "auto"], "batch_size", "auto"),
    (["--batch-size", "AUTO"], "batch_size", "auto"),  # was refused: a mode word, any case
    (["--batch-size", "Auto"], "batch_size", "auto"),
    (["--batch-size", "32"], "batch_size", 32),
    (["--lr", "1e-1"], "lr", 0.1),
    (["--lr", ".1"], "lr", 0.1),
    (["--epochs", "2", "--epochs", "3"], "epochs", 3),  # argparse's convention: the last one given
    (["--epoch", "2"], "epochs", 2),  # an unambiguous prefix, as argparse allows
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
    (["--arch", "wide_resnet50_2"], "arch", "wide_resnet50_2"),
    (["--bn-stats", "first"], "bn_stats", "first"),
    ([], "bn_stats", "mean"),  # make_train_step's default: what runs trained with before the flag
    ([], "bn_mode", "train"),
    (["--bn-mode", "frozen"], "bn_mode", "frozen"),
    (["--label-smoothing", "0.1"], "label_smoothing", 0.1),
    (["--label-smoothing", "1"], "label_smoothing", 1.0),
    ([], "label_smoothing", 0.0),
    # torchvision's recipe flags; their defaults are what runs trained with before them
    ([], "opt", "sgd"),
    (["--opt", "adamw"], "opt", "adamw"),
    (["--wd", "1e-4"], "weight_decay", 1e-4),
    (["--weight-decay", "1e-4"], "weight_decay", 1e-4),
    ([], "norm_weight_decay", None),
    (["--norm-weight-decay", "0"], "norm_weight_decay", 0.0),
    ([], "bias_weight_decay", None),
    (["--bias-weight-decay", "0"], "bias_weight_decay", 0.0),
    ([], "lr_scheduler", "cosineannealinglr"),
    (["--lr-scheduler", "steplr"], "lr_scheduler", "steplr"),
    ([], "lr_step_size", 30),
    (["--lr-step-size", "2"], "lr_step_size", 2),
    ([], "lr_gamma", 0.1),
    (["--lr-gamma", "0.5"], "lr_gamma", 0.5),
    ([], "lr_min", 0.0),
    (["--lr-min", "1e-5"], "lr_min", 1e-5),
    ([], "lr_warmup_epochs", 0),
    (["--lr-warmup-epochs", "5"], "lr_warmup_epochs", 5),
    ([], "lr_warmup_method", "constant"),  # torchvision's default
    (["--lr-warmup-method", "linear"], "lr_warmup_method", "linear"),
    ([], "lr_warmup_decay", 0.01),
    (["--lr-warmup-decay", "0.1"], "lr_warmup_decay", 0.1),
    ([], "clip_grad_norm", None),
    (["--clip-grad-norm", "1"], "clip_grad_norm", 1.0),
    # torchvision's --model-ema, with its defaults
    ([], "model_ema", False),
    (["--model-ema"], "model_ema", True),
    ([], "model_ema_steps", 32),
    (["--model-ema-steps", "4"], "model_ema_steps", 4),
    ([], "model_ema_decay", 0.99998),
    (["--model-ema-decay", "0.999"], "model_ema_decay", 0.999),
    ([], "grad_accum_steps", 1),  # one pass a step: what runs trained with before the flag
    (["--grad-accum-steps", "4"], "grad_accum_steps", 4),
])
def test_values_that_parse(flags, field, value):
    assert getattr(_parsed(*flags), field) == value


@pytest.mark.parametrize("flags, field, value", [
    # torchvision lower-cases --opt and --lr-scheduler, and takes any --opt starting with sgd
    (["--opt", "SGD"], "opt", "sgd"),
    (["--opt", "SGD_Nesterov"], "opt", "sgd-nesterov"),
    (["--opt", "sgd_nesterov"], "opt", "sgd-nesterov"),
    (["--opt", "AdamW"], "opt", "adamw"),
    (["--lr-scheduler", "StepLR"], "lr_scheduler", "steplr"),
    (["--lr-scheduler", "ExponentialLR"], "lr_scheduler", "exponentiallr"),
    (["--lr-scheduler", "CosineAnnealingLR"], "lr_scheduler", "cosineannealinglr"),
    (["--lr-warmup-method", "Linear"], "lr_warmup_method", "linear"),
])
def test_torchvisions_spellings_are_taken_and_recorded_as_one(tmp_path, flags, field, value):
    """A run records these names in its checkpoints, and a --resume compares them: `SGD` and
    `sgd` are one optimizer, and must resume as one."""
    from jaxport.train._loop import _plain

    cfg = _parsed("--workdir", str(tmp_path / "w"), *flags)
    cfg.validate()
    assert getattr(_plain(cfg), field) == value


def test_settings_that_change_the_training_must_agree_across_processes():
    """`_flags` is what every process of a run compares before training: a process with another
    --bn-stats would keep other running statistics and evaluate another model, and one with
    another --label-smoothing would average gradients of two different losses."""
    from jaxport.train._loop import _flags

    assert _flags(_parsed())["--bn-stats"] == "mean"
    assert _flags(_parsed("--bn-stats", "first"))["--bn-stats"] == "first"
    assert _flags(_parsed("--bn-mode", "eval"))["--bn-mode"] == "eval"
    assert _flags(_parsed())["--label-smoothing"] == 0.0
    assert _flags(_parsed("--label-smoothing", "0.1"))["--label-smoothing"] == 0.1
    # torchvision's recipe: another optimizer or schedule on one process trains other weights
    recipe = ["--opt", "adamw", "--norm-weight-decay", "0", "--bias-weight-decay", "0", "--lr-scheduler", "steplr", "--lr-step-size", "2",
              "--lr-gamma", "0.5", "--lr-min", "1e-5", "--lr-warmup-epochs", "1", "--lr-warmup-method", "linear",
              "--lr-warmup-decay", "0.1", "--clip-grad-norm", "2", "--model-ema-steps", "4", "--model-ema-decay", "0.9"]
    default, given = _flags(_parsed()), _flags(_parsed(*recipe))
    for flag, value in zip(recipe[::2], recipe[1::2]):
        assert given[flag] == _parsed(flag, value).__dict__[flag[2:].replace("-", "_")] != default[flag], flag
    # every process saves its part of each checkpoint: one without the EMA would save other items
    assert (default["--model-ema"], _flags(_parsed("--model-ema"))["--model-ema"]) == (False, True)
    # another data order and epoch length on one process would hang its last steps or train other batches
    assert (default["--ra-sampler"], _flags(_parsed("--ra-sampler"))["--ra-sampler"]) == (False, True)
    assert (default["--ra-reps"], _flags(_parsed("--ra-reps", "4"))["--ra-reps"]) == (3, 4)
    # another split of the batch into passes: other BatchNorm statistics, another program
    assert (default["--grad-accum-steps"], _flags(_parsed("--grad-accum-steps", "2"))["--grad-accum-steps"]) == (1, 2)


def test_help_shows_every_flag_with_its_real_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    defaults = TrainConfig(workdir="w")
    for action in train._actions:
        flag = action.option_strings[-1]
        if flag == "--help":
            continue
        assert action.help, f"{flag} has no help text"
        assert flag in text
        if action.dest in TrainConfig.__dataclass_fields__ and action.dest not in ("progress", "workdir"):
            # The default the parser gives is the library's (a CLI run and train(TrainConfig()) agree).
            assert action.default == getattr(defaults, action.dest), flag
        if action.default not in (None, False) and action.dest != "workdir":
            assert f"(default: {action.default})" in text, flag
    # Defaults of None were shown as "(default: None)", a required --workdir included, and flags
    # without help showed no default at all (--epochs, --image-size, --momentum, --seed, ...).
    assert "None" not in text
    assert f"(default: {defaults.epochs})" in text and "(default: 32)" in text and "(default: 0.9)" in text
    assert "(default: 0.0005)" in text and "(default: 0)" in text and "(default: 3)" in text


def test_the_readmes_torchvision_resnet50_recipe_parses_whole():
    """The README's `jaxport train` line for torchvision's ResNet-50 recipe takes every one of the
    recipe's flags: each parses, and each reaches the run's settings."""
    import os
    import shlex

    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    command = re.search(r"\$ (jaxport train --data /data/imagenet --arch resnet50 .*?)\n```", readme, re.S)[1]
    argv = shlex.split(command.replace("\\\n", " "))[1:]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert (cfg.opt, cfg.ra_sampler, cfg.ra_reps, cfg.model_ema, cfg.auto_augment) == ("sgd", True, 4, True, "ta_wide")
    assert (cfg.train_crop_size or cfg.image_size, cfg.val_resize_size, cfg.mixup_alpha, cfg.cutmix_alpha) == (
        176, 232, 0.2, 1.0)
