"""The suite's own settings that protect the machine it runs on."""


def test_passing_tests_leave_no_temporary_files(request):
    # One run of the suite wrote ~15 GB under tmp_path (ResNet checkpoints, workdirs, exported
    # models) and pytest kept every test's directory for the last 3 runs: 33 GB of them, beside
    # earlier clean clones, filled a VM's disk, and the next run failed with hundreds of errors.
    assert request.config.getini("tmp_path_retention_policy") == "failed"
